/* The compiled core of detectors/rank_figures.py: figures(), a step part's per-rank
 * figures from its folded instances.
 *
 * figures(folded, base) computes what rank_figures.figures computes with NumPy (that
 * Python code is the reference; a differential test holds the two equal, bit for bit):
 * per member rank, the sums of the host's lead, instances, waits for the last arriver,
 * TP lateness and the last arriver's exclusive blame, then first arrival and last end as
 * offsets from ``base``. It returns (a bytearray of 9 x k doubles, row after row, k), or
 * None where it cannot (not configured, an instance that is not one, a number past 64
 * bits): the caller
 * then runs the reference. Sums are added in the reference's order (instance by
 * instance, member by member), so the floats come out the same.
 *
 * A part folds hundreds of instances of a few members each and is sealed once; the
 * reference's dozen NumPy calls over arrays it first gathers from the tuples cost more
 * than the arithmetic, which this does in one pass over them.
 *
 * Built by pip install when a C compiler is there (the extension is optional).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NEVER (((int64_t)1) << 62)
enum { ROWS = 9 };
/* where an Instance (detectors/align.py) holds its members' ranks, enqueue times,
 * arrivals and ends, and the folded instance's flags (detectors/rank_figures.py): handed
 * over once by configure(), so that they have one home, the Python code */
static Py_ssize_t i_ranks, i_enq, i_arr, i_end, min_len;
static long wait_model, any_flag;
static int configured;

static PyObject *configure(PyObject *self, PyObject *args) {
    if (!PyArg_ParseTuple(args, "nnnnll", &i_ranks, &i_enq, &i_arr, &i_end, &wait_model,
                          &any_flag))
        return NULL;
    if (i_ranks < 0 || i_enq < 0 || i_arr < 0 || i_end < 0) {
        PyErr_SetString(PyExc_ValueError, "field positions must not be negative");
        return NULL;
    }
    min_len = 1 + (i_ranks > i_enq ? i_ranks : i_enq);
    if (i_arr + 1 > min_len) min_len = i_arr + 1;
    if (i_end + 1 > min_len) min_len = i_end + 1;
    configured = 1;
    Py_RETURN_NONE;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* the items of a tuple as int64 into out; -1: not a tuple of ints that fit (no error set) */
static int ints(PyObject *t, Py_ssize_t n, int64_t *out) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyTuple_GET_ITEM(t, i);
        if (!PyLong_Check(v)) return -1;
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return -1;
        }
        out[i] = (int64_t)x;
    }
    return 0;
}

/* the position, in the instance's members [lo, hi), of the last to arrive (the latest
 * among ties) and of the one before it in that order */
static void last_two(const int64_t *arr, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t *late,
                     Py_ssize_t *before) {
    Py_ssize_t l = lo;
    for (Py_ssize_t i = lo + 1; i < hi; i++)
        if (arr[i] >= arr[l]) l = i;
    Py_ssize_t b = -1;
    for (Py_ssize_t i = lo; i < hi; i++)
        if (i != l && (b < 0 || arr[i] >= arr[b])) b = i;
    *late = l;
    *before = b;
}

static PyObject *figures(PyObject *self, PyObject *args) {
    PyObject *folded;
    long long base;
    if (!PyArg_ParseTuple(args, "O!L", &PyList_Type, &folded, &base)) return NULL;
    if (!configured) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(folded);
    /* sizes and flags of each instance, and the total of members */
    Py_ssize_t *start = PyMem_Malloc((n + 1) * sizeof(Py_ssize_t));
    long *flag = PyMem_Malloc((n ? n : 1) * sizeof(long));
    int64_t *rank = NULL, *enq = NULL, *arr = NULL, *end = NULL, *who = NULL;
    Py_ssize_t *col = NULL;
    double *acc = NULL;
    int64_t *first = NULL, *last = NULL;
    PyObject *result = NULL;
    if (start == NULL || flag == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    start[0] = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *pair = PyList_GET_ITEM(folded, j);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) goto unsupported;
        PyObject *inst = PyTuple_GET_ITEM(pair, 0), *f = PyTuple_GET_ITEM(pair, 1);
        if (!PyTuple_Check(inst) || PyTuple_GET_SIZE(inst) < min_len || !PyLong_Check(f))
            goto unsupported;
        PyObject *ranks = PyTuple_GET_ITEM(inst, i_ranks);
        if (!PyTuple_Check(ranks)) goto unsupported;
        flag[j] = PyLong_AsLong(f);
        if (flag[j] == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto unsupported;
        }
        start[j + 1] = start[j] + PyTuple_GET_SIZE(ranks);
    }
    Py_ssize_t m = start[n];
    size_t cells = (size_t)(m ? m : 1);
    rank = PyMem_Malloc(cells * sizeof(int64_t));
    enq = PyMem_Malloc(cells * sizeof(int64_t));
    arr = PyMem_Malloc(cells * sizeof(int64_t));
    end = PyMem_Malloc(cells * sizeof(int64_t));
    who = PyMem_Malloc(cells * sizeof(int64_t));
    col = PyMem_Malloc(cells * sizeof(Py_ssize_t));
    if (!rank || !enq || !arr || !end || !who || !col) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *inst = PyTuple_GET_ITEM(PyList_GET_ITEM(folded, j), 0);
        Py_ssize_t s = start[j], k = start[j + 1] - s;
        if (ints(PyTuple_GET_ITEM(inst, i_ranks), k, rank + s) < 0 ||
            ints(PyTuple_GET_ITEM(inst, i_enq), k, enq + s) < 0 ||
            ints(PyTuple_GET_ITEM(inst, i_arr), k, arr + s) < 0 ||
            ints(PyTuple_GET_ITEM(inst, i_end), k, end + s) < 0)
            goto unsupported;
    }
    /* the columns: the members of every instance, in their order, where all instances
     * have the same (the usual: a group's part); else every rank once, in rank order */
    Py_ssize_t k = n ? start[1] : 0;
    int same = n > 0;
    for (Py_ssize_t j = 1; same && j < n; j++)
        same = start[j + 1] - start[j] == k && memcmp(rank + start[j], rank, k * sizeof(int64_t)) == 0;
    if (same) {
        memcpy(who, rank, k * sizeof(int64_t));
        for (Py_ssize_t i = 0; i < m; i++) col[i] = i % k;
    } else {
        memcpy(who, rank, m * sizeof(int64_t));
        qsort(who, m, sizeof(int64_t), cmp_i64);
        k = 0;
        for (Py_ssize_t i = 0; i < m; i++)
            if (k == 0 || who[i] != who[k - 1]) who[k++] = who[i];
        for (Py_ssize_t i = 0; i < m; i++) {
            int64_t *at = bsearch(&rank[i], who, k, sizeof(int64_t), cmp_i64);
            col[i] = at - who;
        }
    }
    size_t kk = (size_t)(k ? k : 1);
    acc = PyMem_Calloc(6 * kk, sizeof(double)); /* lead_sum, lead_n, wait, lateness, blame, blame_any */
    first = PyMem_Malloc(kk * sizeof(int64_t));
    last = PyMem_Calloc(kk, sizeof(int64_t));
    if (!acc || !first || !last) {
        PyErr_NoMemory();
        goto done;
    }
    double *lead = acc, *count = acc + kk, *wait = acc + 2 * kk, *late_sum = acc + 3 * kk,
           *blame = acc + 4 * kk, *blame_any = acc + 5 * kk;
    for (Py_ssize_t c = 0; c < k; c++) first[c] = NEVER;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t lo = start[j], hi = start[j + 1];
        if (hi == lo) continue;
        int64_t a_min = arr[lo], a_max = arr[lo], rel_sum = 0;
        for (Py_ssize_t i = lo + 1; i < hi; i++) {
            if (arr[i] < a_min) a_min = arr[i];
            if (arr[i] > a_max) a_max = arr[i];
        }
        int tp = (flag[j] & wait_model) != 0, any = (flag[j] & any_flag) != 0;
        for (Py_ssize_t i = lo; i < hi; i++) rel_sum += arr[i] - a_min;
        double mean = (double)rel_sum / (double)(hi - lo);
        for (Py_ssize_t i = lo; i < hi; i++) {
            Py_ssize_t c = col[i];
            lead[c] += (double)(arr[i] - enq[i]);
            count[c] += 1.0;
            wait[c] += (double)(a_max - arr[i]);
            if (tp) late_sum[c] += (double)(arr[i] - a_min) - mean;
            if (arr[i] < first[c]) first[c] = arr[i];
            if (end[i] > last[c]) last[c] = end[i];
        }
        if (hi - lo >= 2 && (tp || any)) {
            Py_ssize_t l, b;
            last_two(arr, lo, hi, &l, &b);
            double got = (double)(arr[l] - arr[b]);
            if (tp) blame[col[l]] += got;
            if (any) blame_any[col[l]] += got;
        }
    }
    result = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(ROWS * k * sizeof(double)));
    if (result == NULL) goto done;
    double *out = (double *)PyByteArray_AS_STRING(result);
    for (Py_ssize_t c = 0; c < k; c++) {
        out[c] = (double)who[c];
        for (int r = 0; r < 6; r++) out[(1 + r) * k + c] = acc[r * kk + c];
        out[7 * k + c] = (double)(first[c] - (int64_t)base);
        out[8 * k + c] = (double)(last[c] - (int64_t)base);
    }
    PyObject *pair = Py_BuildValue("(Nn)", result, k);
    result = pair;
    goto done;
unsupported:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(start);
    PyMem_Free(flag);
    PyMem_Free(rank);
    PyMem_Free(enq);
    PyMem_Free(arr);
    PyMem_Free(end);
    PyMem_Free(who);
    PyMem_Free(col);
    PyMem_Free(acc);
    PyMem_Free(first);
    PyMem_Free(last);
    return result;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(ranks, enqueue, arrival, end, wait_model, any): Instance's field positions "
     "and the flags"},
    {"figures", figures, METH_VARARGS,
     "figures(folded, base) -> (bytearray of 9 x k doubles, k), or None: see rank_figures"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_figures", NULL, -1, methods};

PyMODINIT_FUNC PyInit__figures(void) { return PyModule_Create(&module); }
