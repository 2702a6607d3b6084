/* The compiled core of detectors/align.py: CollectiveAligner's per-record step.
 *
 * add_many(aligner, records) does exactly what the Python loop over
 * CollectiveAligner._add does (that Python code is the reference; a differential
 * test holds the two equal), on the same state: the aligner's own OrderedDicts,
 * dicts and lists, and _Open objects. So a snapshot pickles the same whichever
 * core made it, and a flow resumed on a machine without this module goes on
 * with the Python one. Nothing here keeps state of its own except the types and
 * constants handed over once by configure().
 *
 * Built by pip install when a C compiler is there (the extension is optional).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* the Collective fields the aligner reads */
enum { F_OP, F_PEER, F_RANK, F_COMM_SIZE, F_SEQ, F_COMM_HASH, F_START, F_ENQ, F_END, F_JOB,
       F_SIZE, NF };
static const char *FIELD[NF] = {"op", "peer", "rank", "comm_size", "seq", "comm_hash",
                                "start_ns", "enqueue_ns", "end_ns", "job", "size_bytes"};

/* the _Open slots */
enum { O_FIRST, O_MEMBERS, O_OP, O_SIZE, O_BYTES, O_JOB, O_REPORTED, O_FINISHED, NO };
static const char *OPEN_SLOT[NO] = {"first_seen_ns", "members", "op", "comm_size",
                                    "size_bytes", "job", "reported", "finished"};

static PyTypeObject *coll_type, *open_type, *inst_type;
static PyObject *op_send, *op_recv;
static PyObject *field_name[NF], *coll_descr[NF], *open_descr[NO];
static PyMemberDef *coll_member[NF], *open_member[NO];
static PyObject *s_open, *s_done, *s_last_seq, *s_recent, *s_max_open, *s_late, *s_ooo,
    *s_dropped, *s_popitem, *minus_one, *minus_two, *zero, *two;
static int configured;

/* a slot's value (new reference), read in place: every member configure() accepted is an
 * object slot (T_OBJECT_EX), which is what PyMember_GetOne would read */
static inline PyObject *read_slot(PyObject *obj, PyMemberDef *m) {
    PyObject *v = *(PyObject **)((char *)obj + m->offset);
    if (v == NULL) {
        PyErr_Format(PyExc_AttributeError, "'%s' object has no attribute '%s'",
                     Py_TYPE(obj)->tp_name, m->name);
        return NULL;
    }
    return Py_NewRef(v);
}

static PyObject *field(PyObject *rec, int i) {
    if (Py_IS_TYPE(rec, coll_type)) return read_slot(rec, coll_member[i]);
    return PyObject_GetAttr(rec, field_name[i]);
}

static PyObject *slot(PyObject *entry, int i) {
    return read_slot(entry, open_member[i]);
}

static int set_slot(PyObject *entry, int i, PyObject *value) {
    PyObject **at = (PyObject **)((char *)entry + open_member[i]->offset);
    Py_XSETREF(*at, Py_NewRef(value));
    return 0;
}

static PyMemberDef *member_of(PyTypeObject *type, const char *name, PyObject **keep) {
    PyObject *d = PyObject_GetAttrString((PyObject *)type, name);
    if (d == NULL) return NULL;
    if (!Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, name);
        Py_DECREF(d);
        return NULL;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX || (m->flags & READONLY && type == open_type)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object slot", type->tp_name, name);
        Py_DECREF(d);
        return NULL;
    }
    *keep = d;
    return m;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *ct, *ot, *it;
    if (!PyArg_ParseTuple(args, "O!O!O!OO", &PyType_Type, &ct, &PyType_Type, &ot, &PyType_Type,
                          &it, &op_send, &op_recv))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)it, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "the instance type must be a named tuple");
        return NULL;
    }
    Py_INCREF(op_send);
    Py_INCREF(op_recv);
    Py_INCREF(ct);
    Py_INCREF(ot);
    Py_INCREF(it);
    coll_type = (PyTypeObject *)ct;
    open_type = (PyTypeObject *)ot;
    inst_type = (PyTypeObject *)it;
    for (int i = 0; i < NF; i++) {
        field_name[i] = PyUnicode_InternFromString(FIELD[i]);
        if (field_name[i] == NULL) return NULL;
        coll_member[i] = member_of(coll_type, FIELD[i], &coll_descr[i]);
        if (coll_member[i] == NULL) return NULL;
    }
    for (int i = 0; i < NO; i++) {
        open_member[i] = member_of(open_type, OPEN_SLOT[i], &open_descr[i]);
        if (open_member[i] == NULL) return NULL;
    }
    configured = 1;
    Py_RETURN_NONE;
}

typedef struct {
    PyObject *open, *done, *last_seq, *recent; /* borrowed from the aligner */
    Py_ssize_t max_open;
    long long late, ooo, dropped;
} State;

/* 1 when a < b, 0 when not, -1 on error (Python's comparison of the two objects) */
static inline int lt(PyObject *a, PyObject *b) {
    if (PyLong_CheckExact(a) && PyLong_CheckExact(b)) {
        int oa, ob;
        long long x = PyLong_AsLongLongAndOverflow(a, &oa);
        long long y = PyLong_AsLongLongAndOverflow(b, &ob);
        if (!oa && !ob) return x < y; /* (neither can fail on an exact int) */
    }
    return PyObject_RichCompareBool(a, b, Py_LT);
}


static PyObject *new_open(PyObject *arrival, PyObject *op, PyObject *size, PyObject *bytes,
                          PyObject *job) {
    PyObject *entry = open_type->tp_alloc(open_type, 0);
    if (entry == NULL) return NULL;
    PyObject *members = PyDict_New();
    if (members == NULL ||
        set_slot(entry, O_FIRST, arrival) < 0 || set_slot(entry, O_MEMBERS, members) < 0 ||
        set_slot(entry, O_OP, op) < 0 || set_slot(entry, O_SIZE, size) < 0 ||
        set_slot(entry, O_BYTES, bytes) < 0 || set_slot(entry, O_JOB, job) < 0 ||
        set_slot(entry, O_REPORTED, Py_False) < 0 || set_slot(entry, O_FINISHED, zero) < 0) {
        Py_XDECREF(members);
        Py_DECREF(entry);
        return NULL;
    }
    Py_DECREF(members);
    return entry;
}

/* CollectiveAligner._instance(key, entry), and max(end) - min(arrival) into *span */
static PyObject *instance(PyObject *key, PyObject *entry, PyObject *members, PyObject **span) {
    PyObject *ranks = NULL, *enq = NULL, *arr = NULL, *end = NULL, *inst = NULL;
    PyObject *job = NULL, *op = NULL, *size = NULL, *bytes = NULL;
    PyObject *keys = PyDict_Keys(members);
    if (keys == NULL || PyList_Sort(keys) < 0) goto done;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    ranks = PyList_AsTuple(keys);
    enq = PyTuple_New(n);
    arr = PyTuple_New(n);
    end = PyTuple_New(n);
    if (ranks == NULL || enq == NULL || arr == NULL || end == NULL) goto done;
    PyObject *a_min = NULL, *e_max = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyDict_GetItemWithError(members, PyList_GET_ITEM(keys, i));
        if (m == NULL || !PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 3) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a member is not (enq, a, e)");
            goto done;
        }
        PyObject *a = PyTuple_GET_ITEM(m, 1), *e = PyTuple_GET_ITEM(m, 2);
        Py_INCREF(PyTuple_GET_ITEM(m, 0));
        PyTuple_SET_ITEM(enq, i, PyTuple_GET_ITEM(m, 0));
        Py_INCREF(a);
        PyTuple_SET_ITEM(arr, i, a);
        Py_INCREF(e);
        PyTuple_SET_ITEM(end, i, e);
        int c;
        if (a_min == NULL || (c = lt(a, a_min)) > 0) a_min = a;
        else if (c < 0) goto done;
        if (e_max == NULL || (c = lt(e_max, e)) > 0) e_max = e;
        else if (c < 0) goto done;
    }
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "an instance without members");
        goto done;
    }
    if ((*span = PyNumber_Subtract(e_max, a_min)) == NULL) goto done;
    if ((job = slot(entry, O_JOB)) == NULL || (op = slot(entry, O_OP)) == NULL ||
        (size = slot(entry, O_SIZE)) == NULL || (bytes = slot(entry, O_BYTES)) == NULL)
        goto done;
    inst = inst_type->tp_alloc(inst_type, 12);
    if (inst == NULL) goto done;
    /* Instance(job, comm, seq, op, sender, comm_size, size_bytes, ranks, enqueue, arrival,
     *          end, receiver); key = (comm, sender, receiver, seq) */
    PyObject *items[12] = {job, PyTuple_GET_ITEM(key, 0), PyTuple_GET_ITEM(key, 3), op,
                           PyTuple_GET_ITEM(key, 1), size, bytes, ranks, enq, arr, end,
                           PyTuple_GET_ITEM(key, 2)};
    for (int i = 0; i < 12; i++) {
        Py_INCREF(items[i]);
        PyTuple_SET_ITEM(inst, i, items[i]);
    }
done:
    if (inst == NULL) Py_CLEAR(*span);
    Py_XDECREF(keys);
    Py_XDECREF(ranks);
    Py_XDECREF(enq);
    Py_XDECREF(arr);
    Py_XDECREF(end);
    Py_XDECREF(job);
    Py_XDECREF(op);
    Py_XDECREF(size);
    Py_XDECREF(bytes);
    return inst;
}

/* drop the oldest key: a dict's first (insertion order), an OrderedDict's popitem(False) */
static int pop_oldest(PyObject *odict) {
    if (PyDict_CheckExact(odict)) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        if (!PyDict_Next(odict, &pos, &k, &v)) return 0;
        Py_INCREF(k);
        int r = PyDict_DelItem(odict, k);
        Py_DECREF(k);
        return r;
    }
    PyObject *r = PyObject_CallMethodObjArgs(odict, s_popitem, Py_False, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* One record: a new reference to the instance it completed, Py_None (new reference) when it
 * completed none, NULL on error. */
static PyObject *add(State *st, PyObject *rec) {
    PyObject *f[NF] = {NULL};
    PyObject *key = NULL, *stream = NULL, *entry = NULL, *members = NULL, *fin = NULL,
             *size = NULL, *triple = NULL, *out = NULL;
    for (int i = 0; i < NF; i++)
        if ((f[i] = field(rec, i)) == NULL) goto done;
    PyObject *op = f[F_OP], *rank = f[F_RANK], *seq = f[F_SEQ];
    PyObject *peer = f[F_PEER] != Py_None ? f[F_PEER] : minus_two;
    PyObject *sender, *receiver;
    if (op == op_send) sender = rank, receiver = peer;
    else if (op == op_recv) sender = peer, receiver = rank;
    else sender = receiver = minus_one;
    int c = lt(two, f[F_COMM_SIZE]); /* comm_size <= 2: a pair's, the sender implies it */
    if (c < 0) goto done;
    if (!c) receiver = minus_one;
    if ((key = PyTuple_Pack(4, f[F_COMM_HASH], sender, receiver, seq)) == NULL) goto done;
    if ((c = PyDict_Contains(st->done, key)) < 0) goto done;
    if (c) {
        st->late++;
        out = Py_NewRef(Py_None);
        goto done;
    }
    if ((stream = PyTuple_Pack(3, rank, sender, receiver)) == NULL) goto done;
    PyObject *prev = PyDict_GetItemWithError(st->last_seq, stream);
    if (prev == NULL && PyErr_Occurred()) goto done;
    if (prev == NULL || (c = lt(prev, seq)) > 0) {
        if (PyObject_SetItem(st->last_seq, stream, seq) < 0) goto done;
    } else if (c < 0) {
        goto done;
    } else if ((c = lt(seq, prev)) > 0) {
        st->ooo++;
    } else if (c < 0) {
        goto done;
    }
    PyObject *arrival = f[F_START] != Py_None ? f[F_START] : f[F_ENQ];
    int sends = PyObject_RichCompareBool(sender, minus_one, Py_NE); /* (same object: free) */
    if (sends < 0) goto done;
    entry = Py_XNewRef(PyDict_GetItemWithError(st->open, key));
    if (entry == NULL) {
        if (PyErr_Occurred()) goto done;
        entry = new_open(arrival, sends ? op_send : op, sends ? two : f[F_COMM_SIZE], f[F_SIZE],
                         f[F_JOB]);
        if (entry == NULL || PyObject_SetItem(st->open, key, entry) < 0) goto done;
        if (PyDict_GET_SIZE(st->open) > st->max_open) {
            if (pop_oldest(st->open) < 0) goto done;
            st->dropped++;
        }
    }
    PyObject *end = f[F_END] != Py_None ? f[F_END] : minus_one;
    if ((members = slot(entry, O_MEMBERS)) == NULL || (fin = slot(entry, O_FINISHED)) == NULL)
        goto done;
    if (!PyDict_Check(members)) {
        PyErr_SetString(PyExc_TypeError, "an open instance's members are not a dict");
        goto done;
    }
    long long finished = PyLong_AsLongLong(fin);
    if (finished == -1 && PyErr_Occurred()) goto done;
    PyObject *before = PyDict_GetItemWithError(members, rank);
    if (before == NULL && PyErr_Occurred()) goto done;
    if (before != NULL) {
        PyObject *b_end = PySequence_GetItem(before, 2);
        if (b_end == NULL) goto done;
        c = lt(b_end, zero);
        Py_DECREF(b_end);
        if (c < 0) goto done;
        if (!c) finished--;
    }
    if ((triple = PyTuple_Pack(3, f[F_ENQ], arrival, end)) == NULL ||
        PyDict_SetItem(members, rank, triple) < 0)
        goto done;
    if ((c = lt(end, zero)) < 0) goto done;
    if (!c) finished++;
    Py_SETREF(fin, PyLong_FromLongLong(finished));
    if (fin == NULL || set_slot(entry, O_FINISHED, fin) < 0 ||
        set_slot(entry, O_REPORTED, Py_False) < 0)
        goto done;
    if ((size = slot(entry, O_SIZE)) == NULL) goto done;
    long long n = PyLong_AsLongLong(size);
    if (n == -1 && PyErr_Occurred()) goto done;
    if (finished < n || PyDict_GET_SIZE(members) < n) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *span = NULL;
    PyObject *inst = instance(key, entry, members, &span);
    if (inst == NULL) goto done;
    if (PyObject_DelItem(st->open, key) < 0 || PyObject_SetItem(st->done, key, Py_None) < 0 ||
        (PyDict_GET_SIZE(st->done) > 4 * st->max_open && pop_oldest(st->done) < 0) ||
        PyList_Append(st->recent, span) < 0 ||
        (PyList_GET_SIZE(st->recent) > 64 && PyList_SetSlice(st->recent, 0, 32, NULL) < 0)) {
        Py_DECREF(inst);
        Py_DECREF(span);
        goto done;
    }
    Py_DECREF(span);
    out = inst;
done:
    for (int i = 0; i < NF; i++) Py_XDECREF(f[i]);
    Py_XDECREF(key);
    Py_XDECREF(stream);
    Py_XDECREF(entry);
    Py_XDECREF(members);
    Py_XDECREF(fin);
    Py_XDECREF(size);
    Py_XDECREF(triple);
    return out;
}

static int add_count(PyObject *aligner, PyObject *name, long long n) {
    if (n == 0) return 0;
    PyObject *was = PyObject_GetAttr(aligner, name);
    if (was == NULL) return -1;
    PyObject *by = PyLong_FromLongLong(n);
    PyObject *now = by ? PyNumber_Add(was, by) : NULL;
    Py_DECREF(was);
    Py_XDECREF(by);
    if (now == NULL) return -1;
    int r = PyObject_SetAttr(aligner, name, now);
    Py_DECREF(now);
    return r;
}

static PyObject *add_many(PyObject *self, PyObject *args) {
    PyObject *aligner, *records;
    if (!PyArg_ParseTuple(args, "OO!", &aligner, &PyList_Type, &records)) return NULL;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "detectors._align.configure() was not called");
        return NULL;
    }
    State st = {0};
    PyObject *out = NULL, *max_open = NULL;
    PyObject *own[4] = {NULL};
    PyObject *names[4] = {s_open, s_done, s_last_seq, s_recent};
    for (int i = 0; i < 4; i++)
        if ((own[i] = PyObject_GetAttr(aligner, names[i])) == NULL) goto done;
    st.open = own[0], st.done = own[1], st.last_seq = own[2], st.recent = own[3];
    if (!PyDict_Check(st.open) || !PyDict_Check(st.done) || !PyDict_Check(st.last_seq) ||
        !PyList_Check(st.recent)) {
        PyErr_SetString(PyExc_TypeError, "the aligner's state is not its dicts and list");
        goto done;
    }
    if ((max_open = PyObject_GetAttr(aligner, s_max_open)) == NULL) goto done;
    st.max_open = PyLong_AsSsize_t(max_open);
    if (st.max_open == -1 && PyErr_Occurred()) goto done;
    if ((out = PyList_New(0)) == NULL) goto done;
    Py_ssize_t n = PyList_GET_SIZE(records);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *inst = add(&st, PyList_GET_ITEM(records, i));
        if (inst == NULL) {
            Py_CLEAR(out);
            break;
        }
        if (inst != Py_None && PyList_Append(out, inst) < 0) {
            Py_DECREF(inst);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(inst);
    }
done:
    /* the counts of what was done before an error stay counted, as in Python */
    if (st.open != NULL) {
        PyObject *exc_type, *exc, *tb;
        PyErr_Fetch(&exc_type, &exc, &tb);
        if (add_count(aligner, s_late, st.late) < 0 || add_count(aligner, s_ooo, st.ooo) < 0 ||
            add_count(aligner, s_dropped, st.dropped) < 0) {
            Py_CLEAR(out);
            Py_XDECREF(exc_type), Py_XDECREF(exc), Py_XDECREF(tb);
        } else {
            PyErr_Restore(exc_type, exc, tb);
        }
    }
    for (int i = 0; i < 4; i++) Py_XDECREF(own[i]);
    Py_XDECREF(max_open);
    return out;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(collective_type, open_type, instance_type, send, recv): the types and ops."},
    {"add_many", add_many, METH_VARARGS,
     "add_many(aligner, records): CollectiveAligner._add over records; the completed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "detectors._align",
                                    "The compiled core of detectors.align.", -1, methods};

PyMODINIT_FUNC PyInit__align(void) {
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(s_open, "_open");
    INTERN(s_done, "_done");
    INTERN(s_last_seq, "_last_seq");
    INTERN(s_recent, "_recent");
    INTERN(s_max_open, "max_open");
    INTERN(s_late, "late");
    INTERN(s_ooo, "out_of_order");
    INTERN(s_dropped, "dropped");
    INTERN(s_popitem, "popitem");
#undef INTERN
    if ((minus_one = PyLong_FromLong(-1)) == NULL || (minus_two = PyLong_FromLong(-2)) == NULL ||
        (zero = PyLong_FromLong(0)) == NULL || (two = PyLong_FromLong(2)) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
