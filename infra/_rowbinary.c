/* The compiled encoder of infra/rowbinary.py: schema records as ClickHouse RowBinary.
 *
 * encode(plan, records) -> bytes writes exactly what rowbinary.encode_py writes (that
 * Python code is the reference; a differential test holds the two equal, and another
 * that ClickHouse stores the same rows from either format as from the records' JSON).
 *
 * A plan is built in Python by rowbinary.plan_for() from the table's column types:
 *     plan  = (record type, ((member descriptor, code), ...))   one item per column
 *     code  = INT64 | UINT64 | FLOAT64 | BOOL | STRING          (an int)
 *           | (NULLABLE, code) | (ARRAY, code) | (MAP, code, code) | (TUPLE, plan)
 * Fields are read in place through their member descriptors (object slots, as
 * msgspec lays a Struct out); a record of another type is a TypeError.
 *
 * Built by pip install when a C compiler is there (the extension is optional).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

enum { INT64 = 1, UINT64, FLOAT64, BOOL, STRING, NULLABLE, ARRAY, MAP, TUPLE };

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int reserve(Buf *b, Py_ssize_t more) {
    if (b->len + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more) cap *= 2;
    char *data = PyMem_Realloc(b->data, cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int put(Buf *b, const void *src, Py_ssize_t n) {
    if (reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

static int put_byte(Buf *b, unsigned char c) { return put(b, &c, 1); }

static int put_varint(Buf *b, unsigned long long n) {
    unsigned char out[10];
    int i = 0;
    do {
        unsigned char c = n & 0x7f;
        n >>= 7;
        out[i++] = n ? (c | 0x80) : c;
    } while (n);
    return put(b, out, i);
}

static int put_le64(Buf *b, unsigned long long v) {
    unsigned char out[8];
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(v >> (8 * i));
    return put(b, out, 8);
}

static int malformed(void) {
    PyErr_SetString(PyExc_ValueError, "malformed RowBinary plan");
    return -1;
}

static int encode_struct(Buf *b, PyObject *plan, PyObject *rec);

static int wrong(const char *what, PyObject *v) {
    PyErr_Format(PyExc_TypeError, "RowBinary %s column: cannot encode a %s", what,
                 Py_TYPE(v)->tp_name);
    return -1;
}

static int encode_value(Buf *b, PyObject *code, PyObject *v) {
    if (PyLong_CheckExact(code)) {
        switch (PyLong_AsLong(code)) {
        case INT64: {
            if (!PyLong_Check(v)) return wrong("Int64", v);
            long long x = PyLong_AsLongLong(v);
            if (x == -1 && PyErr_Occurred()) return -1;
            return put_le64(b, (unsigned long long)x);
        }
        case UINT64: {
            if (!PyLong_Check(v)) return wrong("UInt64", v);
            unsigned long long x = PyLong_AsUnsignedLongLong(v);
            if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
            return put_le64(b, x);
        }
        case FLOAT64: {
            if (!PyFloat_Check(v) && !PyLong_Check(v)) return wrong("Float64", v);
            double x = PyFloat_AsDouble(v);
            if (x == -1.0 && PyErr_Occurred()) return -1;
            unsigned long long bits;
            memcpy(&bits, &x, 8);
            return put_le64(b, bits);
        }
        case BOOL:
            if (!PyBool_Check(v)) return wrong("Bool", v);
            return put_byte(b, v == Py_True);
        case STRING: {
            if (!PyUnicode_Check(v)) return wrong("String", v);
            Py_ssize_t n;
            const char *s = PyUnicode_AsUTF8AndSize(v, &n);
            if (s == NULL) return -1;
            if (put_varint(b, (unsigned long long)n) < 0) return -1;
            return put(b, s, n);
        }
        }
    } else {
        PyObject *arg = PyTuple_GET_ITEM(code, 1);
        switch (PyLong_AsLong(PyTuple_GET_ITEM(code, 0))) {
        case NULLABLE:
            if (v == Py_None) return put_byte(b, 1);
            if (put_byte(b, 0) < 0) return -1;
            return encode_value(b, arg, v);
        case ARRAY: {
            if (!PyList_Check(v) && !PyTuple_Check(v)) return wrong("Array", v);
            PyObject *seq = PySequence_Fast(v, "");
            if (seq == NULL) return -1;
            Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
            int rc = put_varint(b, (unsigned long long)n);
            for (Py_ssize_t i = 0; rc == 0 && i < n; i++)
                rc = encode_value(b, arg, PySequence_Fast_GET_ITEM(seq, i));
            Py_DECREF(seq);
            return rc;
        }
        case MAP: {
            if (!PyDict_Check(v)) return wrong("Map", v);
            PyObject *vcode = PyTuple_GET_ITEM(code, 2), *key, *value;
            Py_ssize_t pos = 0;
            if (put_varint(b, (unsigned long long)PyDict_GET_SIZE(v)) < 0) return -1;
            while (PyDict_Next(v, &pos, &key, &value))
                if (encode_value(b, arg, key) < 0 || encode_value(b, vcode, value) < 0)
                    return -1;
            return 0;
        }
        case TUPLE:
            return encode_struct(b, arg, v);
        }
    }
    return malformed();
}

static int check_plan(PyObject *plan);

static int check_code(PyObject *code) {
    if (PyLong_CheckExact(code)) {
        long c = PyLong_AsLong(code);
        return c >= INT64 && c <= STRING ? 0 : malformed();
    }
    if (!PyTuple_CheckExact(code) || PyTuple_GET_SIZE(code) < 2 ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(code, 0)))
        return malformed();
    Py_ssize_t n = PyTuple_GET_SIZE(code);
    PyObject *arg = PyTuple_GET_ITEM(code, 1);
    switch (PyLong_AsLong(PyTuple_GET_ITEM(code, 0))) {
    case NULLABLE:
    case ARRAY:
        return n == 2 ? check_code(arg) : malformed();
    case MAP:
        return n == 3 && check_code(arg) == 0 ? check_code(PyTuple_GET_ITEM(code, 2)) : malformed();
    case TUPLE:
        return n == 2 ? check_plan(arg) : malformed();
    }
    return malformed();
}

/* once per call, so that encoding trusts the plan: (type, ((object slot of type, code), ...)) */
static int check_plan(PyObject *plan) {
    if (!PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != 2 ||
        !PyType_Check(PyTuple_GET_ITEM(plan, 0)) || !PyTuple_CheckExact(PyTuple_GET_ITEM(plan, 1)))
        return malformed();
    PyTypeObject *type = (PyTypeObject *)PyTuple_GET_ITEM(plan, 0);
    PyObject *fields = PyTuple_GET_ITEM(plan, 1);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fields); i++) {
        PyObject *item = PyTuple_GET_ITEM(fields, i), *descr;
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2 ||
            !Py_IS_TYPE(descr = PyTuple_GET_ITEM(item, 0), &PyMemberDescr_Type))
            return malformed();
        PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type != T_OBJECT_EX || !PyType_IsSubtype(type, ((PyDescrObject *)descr)->d_type)) {
            PyErr_Format(PyExc_ValueError, "%s is not an object slot of %s", m->name,
                         type->tp_name);
            return -1;
        }
        if (check_code(PyTuple_GET_ITEM(item, 1)) < 0) return -1;
    }
    return 0;
}

/* the error raised by field `name` of a `type` record, naming them */
static void name_error(PyTypeObject *type, const char *name) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyErr_Format(t ? t : PyExc_TypeError, "%s.%s: %S", type->tp_name, name, v ? v : Py_None);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
}

/* a record by a checked plan */
static int encode_struct(Buf *b, PyObject *plan, PyObject *rec) {
    PyTypeObject *type = (PyTypeObject *)PyTuple_GET_ITEM(plan, 0);
    PyObject *fields = PyTuple_GET_ITEM(plan, 1);
    if (!Py_IS_TYPE(rec, type)) {
        PyErr_Format(PyExc_TypeError, "this RowBinary plan encodes %s records, not %s",
                     type->tp_name, Py_TYPE(rec)->tp_name);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fields); i++) {
        PyObject *item = PyTuple_GET_ITEM(fields, i);
        PyMemberDef *m = ((PyMemberDescrObject *)PyTuple_GET_ITEM(item, 0))->d_member;
        PyObject *v = *(PyObject **)((char *)rec + m->offset);
        if (v == NULL) {
            PyErr_Format(PyExc_AttributeError, "'%s' object has no attribute '%s'",
                         type->tp_name, m->name);
            return -1;
        }
        if (encode_value(b, PyTuple_GET_ITEM(item, 1), v) < 0) {
            name_error(type, m->name);
            return -1;
        }
    }
    return 0;
}

static PyObject *encode(PyObject *self, PyObject *args) {
    PyObject *plan, *records;
    if (!PyArg_ParseTuple(args, "OO", &plan, &records)) return NULL;
    PyObject *seq = PySequence_Fast(records, "records must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Buf b = {NULL, 0, 0};
    if (check_plan(plan) < 0) goto fail;
    if (reserve(&b, n * 128 + 1) < 0) goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        if (encode_struct(&b, plan, PySequence_Fast_GET_ITEM(seq, i)) < 0) goto fail;
    Py_DECREF(seq);
    PyObject *out = PyBytes_FromStringAndSize(b.data, b.len);
    PyMem_Free(b.data);
    return out;
fail:
    Py_DECREF(seq);
    PyMem_Free(b.data);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(plan, records) -> bytes: the records as RowBinary rows (see the module)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "infra._rowbinary",
                                    "The compiled encoder of infra.rowbinary.", -1, methods};

PyMODINIT_FUNC PyInit__rowbinary(void) { return PyModule_Create(&module); }
