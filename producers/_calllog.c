/* The compiled reader of the original MEGATRACE collector's call logs: what
 * producers/megatrace_lines.py's parse_text does in Python (that code is the
 * reference; a differential test holds the two equal on generated lines, valid
 * and broken).
 *
 * parse(text, line_type, funcs) returns the call lines of an ASCII text as
 * line_type tuples, or None for a text with any other character: the reference's
 * regular expression reads Unicode digits, letters and spaces as such, and only
 * the reference reads those. A line is a call line exactly where the reference's
 * _LINE matches it; one whose function funcs does not know, or whose stream or
 * opCount is no number, is left out, as the reference leaves it out.
 *
 * Built by pip install when a C compiler is there (the extension is optional).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* \s of a str pattern, over ASCII */
static inline int is_space(unsigned char c) {
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}
static inline int is_blank(unsigned char c) { return c == ' ' || c == '\t'; }
static inline int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static inline int is_word(unsigned char c) {
    return is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

typedef struct {
    const char *p;
    Py_ssize_t n;
} span;

/* [ \t]+ at *p (at least one); moves *p past them */
static inline int blanks(const char **p, const char *e) {
    const char *q = *p;
    while (q < e && is_blank((unsigned char)*q)) q++;
    if (q == *p) return 0;
    *p = q;
    return 1;
}

static inline int literal(const char **p, const char *e, const char *lit, Py_ssize_t n) {
    if (e - *p < n || memcmp(*p, lit, n) != 0) return 0;
    *p += n;
    return 1;
}

static inline int token(const char **p, const char *e, span *out, int (*ok)(unsigned char)) {
    const char *q = *p;
    while (q < e && ok((unsigned char)*q)) q++;
    if (q == *p) return 0;
    out->p = *p;
    out->n = q - *p;
    *p = q;
    return 1;
}

static int not_space(unsigned char c) { return !is_space(c); }
static int word(unsigned char c) { return is_word(c); }
static int a_digit(unsigned char c) { return is_digit(c); }

/* \d+ at *p */
static inline int digits(const char **p, const char *e, span *out) {
    return token(p, e, out, a_digit);
}

typedef struct {
    span sec, frac, rank, fun, data, stream, opc, gh;
} fields;

/* the reference's _LINE on one line [s, e) (no '\n' in it) */
static int match(const char *s, const char *e, fields *f) {
    const char *p = s;
    while (p < e && is_blank((unsigned char)*p)) p++;
    const char *head = p;
    span ignored;
    if (!(literal(&p, e, "[save_count ", 12) && digits(&p, e, &ignored) &&
          literal(&p, e, "]", 1) && blanks(&p, e)))
        p = head; /* the optional prefix is not there */
    if (!(literal(&p, e, "[", 1) && digits(&p, e, &f->sec) && literal(&p, e, ".", 1) &&
          digits(&p, e, &f->frac) && literal(&p, e, "]", 1) && blanks(&p, e) &&
          literal(&p, e, "[Rank ", 6) && digits(&p, e, &f->rank) && literal(&p, e, "]", 1) &&
          blanks(&p, e) && literal(&p, e, "Fun ", 4) && token(&p, e, &f->fun, word) &&
          blanks(&p, e) && literal(&p, e, "Data ", 5) && digits(&p, e, &f->data) &&
          blanks(&p, e) && literal(&p, e, "stream ", 7) &&
          token(&p, e, &f->stream, not_space)))
        return 0;
    /* the optional groups, each all or nothing (what follows a token is never part of
     * it, so the regular expression has nothing to backtrack into) */
    const char *q = p;
    f->opc.n = 0;
    if (blanks(&q, e) && literal(&q, e, "opCount ", 8) && token(&q, e, &f->opc, not_space))
        p = q;
    else
        f->opc.n = 0;
    q = p;
    f->gh.n = 0;
    if (blanks(&q, e) && literal(&q, e, "groupHash ", 10)) {
        const char *sign = q;
        if (q < e && *q == '-') q++;
        span d;
        if (digits(&q, e, &d)) {
            f->gh.p = sign;
            f->gh.n = q - sign;
            p = q;
        }
    }
    while (p < e && (is_blank((unsigned char)*p) || *p == '\r')) p++;
    return p == e;
}

/* int(text, base) of a span; NULL with no exception set where int() would refuse it */
static PyObject *to_int(span s, int base) {
    char small[64];
    char *buf = s.n < (Py_ssize_t)sizeof(small) ? small : PyMem_Malloc(s.n + 1);
    if (buf == NULL) return PyErr_NoMemory();
    memcpy(buf, s.p, s.n);
    buf[s.n] = '\0';
    PyObject *v = PyLong_FromString(buf, NULL, base);
    if (buf != small) PyMem_Free(buf);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_ValueError)) PyErr_Clear();
    return v;
}

/* a run of decimal digits (as \d+ read them) */
static PyObject *decimal(span s) {
    if (s.n <= 19) { /* under 2**64 */
        unsigned long long v = 0;
        for (Py_ssize_t i = 0; i < s.n; i++) v = v * 10 + (unsigned)(s.p[i] - '0');
        return PyLong_FromUnsignedLongLong(v);
    }
    return to_int(s, 10);
}

/* seconds and a fraction as nanoseconds: the fraction's first nine digits, padded */
static PyObject *timestamp(span sec, span frac) {
    char buf[256];
    char *b = sec.n + 9 <= (Py_ssize_t)sizeof(buf) ? buf : PyMem_Malloc(sec.n + 9);
    if (b == NULL) return PyErr_NoMemory();
    memcpy(b, sec.p, sec.n);
    for (Py_ssize_t i = 0; i < 9; i++) b[sec.n + i] = i < frac.n ? frac.p[i] : '0';
    span all = {b, sec.n + 9};
    PyObject *v = decimal(all);
    if (b != buf) PyMem_Free(b);
    return v;
}

/* the stream: "(nil)" (glibc's %p of a null pointer: the default stream) is 0 */
static PyObject *stream_of(span s) {
    if (s.n == 5 && memcmp(s.p, "(nil)", 5) == 0) return PyLong_FromLong(0);
    int hex = s.n >= 2 && s.p[0] == '0' && (s.p[1] == 'x' || s.p[1] == 'X');
    if (hex && s.n <= 18) {
        unsigned long long v = 0;
        Py_ssize_t i = 2;
        for (; i < s.n; i++) {
            unsigned char c = (unsigned char)s.p[i];
            unsigned d = is_digit(c)               ? c - '0'
                         : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                         : (c >= 'A' && c <= 'F') ? c - 'A' + 10
                                                  : 16;
            if (d == 16) break;
            v = v * 16 + d;
        }
        if (i == s.n && s.n > 2) return PyLong_FromUnsignedLongLong(v);
    }
    return to_int(s, hex ? 16 : 10);
}

/* the groupHash, signed in the log, as its unsigned 64 bits */
static PyObject *group_hash(span s, PyObject *u64) {
    Py_ssize_t neg = s.n > 0 && s.p[0] == '-';
    if (s.n - neg <= 19) { /* under 2**64: its two's complement, modulo 2**64 */
        unsigned long long v = 0;
        for (Py_ssize_t i = neg; i < s.n; i++) v = v * 10 + (unsigned)(s.p[i] - '0');
        return PyLong_FromUnsignedLongLong(neg ? 0ULL - v : v);
    }
    PyObject *v = to_int(s, 10);
    if (v == NULL) return NULL;
    PyObject *out = PyNumber_And(v, u64);
    Py_DECREF(v);
    return out;
}

/* the last few function names seen, and their ops (a log has a handful) */
#define NAMES 16
typedef struct {
    char name[32];
    Py_ssize_t n;
    PyObject *op; /* borrowed from funcs; Py_None: a function NCCL does not have */
} name_entry;

static PyObject *op_of(span fun, PyObject *funcs, name_entry *names, int *used) {
    for (int i = 0; i < *used; i++)
        if (names[i].n == fun.n && memcmp(names[i].name, fun.p, fun.n) == 0) return names[i].op;
    PyObject *key = PyUnicode_FromStringAndSize(fun.p, fun.n);
    if (key == NULL) return NULL;
    PyObject *op = PyDict_GetItemWithError(funcs, key);
    Py_DECREF(key);
    if (op == NULL && PyErr_Occurred()) return NULL;
    if (op == NULL) op = Py_None;
    if (*used < NAMES && fun.n < (Py_ssize_t)sizeof(names[0].name)) {
        memcpy(names[*used].name, fun.p, fun.n);
        names[*used].n = fun.n;
        names[*used].op = op;
        (*used)++;
    }
    return op;
}

/* one call line as a line_type tuple; NULL with no exception: not a call line */
static PyObject *call_line(fields *f, PyTypeObject *line_type, PyObject *op, PyObject *u64) {
    PyObject *v[7] = {NULL};
    v[4] = stream_of(f->stream);
    if (v[4] == NULL) return NULL;
    if (f->opc.n) {
        v[5] = to_int(f->opc, 0);
        if (v[5] == NULL) goto fail;
    } else {
        v[5] = Py_NewRef(Py_None);
    }
    v[6] = f->gh.n ? group_hash(f->gh, u64) : Py_NewRef(Py_None);
    v[0] = timestamp(f->sec, f->frac);
    v[1] = decimal(f->rank);
    v[2] = Py_NewRef(op);
    v[3] = decimal(f->data);
    for (int i = 0; i < 7; i++)
        if (v[i] == NULL) goto fail;
    /* a tuple of line_type, made as tuple.__new__(line_type, ...) makes it */
    PyObject *out = line_type->tp_alloc(line_type, 7);
    if (out == NULL) goto fail;
    for (int i = 0; i < 7; i++) PyTuple_SET_ITEM(out, i, v[i]);
    return out;
fail:
    for (int i = 0; i < 7; i++) Py_XDECREF(v[i]);
    return NULL;
}

static PyObject *parse(PyObject *self, PyObject *args) {
    PyObject *text, *funcs;
    PyTypeObject *line_type;
    if (!PyArg_ParseTuple(args, "UO!O!", &text, &PyType_Type, &line_type, &PyDict_Type, &funcs))
        return NULL;
    if (!PyType_IsSubtype(line_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "line_type must be a tuple type");
        return NULL;
    }
    if (!PyUnicode_IS_ASCII(text)) Py_RETURN_NONE;
    Py_ssize_t size;
    const char *s = PyUnicode_AsUTF8AndSize(text, &size);
    if (s == NULL) return NULL;
    const char *end = s + size;
    PyObject *u64 = PyLong_FromUnsignedLongLong(~0ULL);
    PyObject *out = PyList_New(0);
    if (u64 == NULL || out == NULL) goto fail;
    name_entry names[NAMES];
    int used = 0;
    fields f;
    while (s <= end) {
        const char *nl = memchr(s, '\n', end - s);
        const char *e = nl ? nl : end;
        if (e > s && match(s, e, &f)) {
            PyObject *op = op_of(f.fun, funcs, names, &used);
            if (op == NULL) goto fail;
            if (op != Py_None) {
                PyObject *line = call_line(&f, line_type, op, u64);
                if (line == NULL && PyErr_Occurred()) goto fail;
                if (line != NULL) {
                    int err = PyList_Append(out, line);
                    Py_DECREF(line);
                    if (err) goto fail;
                }
            }
        }
        if (nl == NULL) break;
        s = nl + 1;
    }
    Py_DECREF(u64);
    return out;
fail:
    Py_XDECREF(u64);
    Py_XDECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"parse", parse, METH_VARARGS,
     "parse(text, line_type, funcs) -> the call lines of an ASCII text (None: not ASCII)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_calllog", NULL, -1, methods};

PyMODINIT_FUNC PyInit__calllog(void) { return PyModule_Create(&module); }
