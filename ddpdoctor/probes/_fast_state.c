/* State: the part of the collector (probes/collector.py) that the probes read and write on
 * every event, as the fields of one C object, the collector's base class.
 *
 * As instance attributes these lived in the collector's dict: a probe's read was a dict lookup
 * (about 120 instructions) and its write a dict store (about 200), some twenty of each per
 * tiny step. As members they are a load and a store, and Python reads and writes them as it
 * did, through member descriptors. The counters and times are C integers (Python sees ints);
 * everything else is any object, as before. A field never set reads as AttributeError. The
 * fields are declared once, in _fast.h's STATE_INTS and STATE_OBJECTS.
 */
#include "_fast.h"
#include <structmember.h>

static int State_traverse(State *self, visitproc visit, void *arg) {
#define VISIT(name, doc) Py_VISIT(self->name);
    STATE_OBJECTS(VISIT)
#undef VISIT
    Py_VISIT(self->progress.obj);
    Py_VISIT(self->pack.writer);
    Py_VISIT(self->pack.ring.ring);
    for (int i = 0; i < PACKERS; i++) {
        Py_VISIT(self->pack.kinds[i]);
        Py_VISIT(self->pack.packers[i]);
    }
    return 0;
}

static int State_clear(State *self) {
#define CLEAR(name, doc) Py_CLEAR(self->name);
    STATE_OBJECTS(CLEAR)
#undef CLEAR
    Py_CLEAR(self->progress.obj);
    Py_CLEAR(self->pack.writer);
    ring_clear(&self->pack.ring);
    for (int i = 0; i < PACKERS; i++) {
        Py_CLEAR(self->pack.kinds[i]);
        Py_CLEAR(self->pack.packers[i]);
    }
    return 0;
}

void progress_enter(State *s, Progress *saved, PyObject *phase, PyObject *op, PyObject *seq, PyObject *src,
                    const signed char *tail, int64_t t0) {
    *saved = s->progress;
    s->progress = (Progress){NULL, phase, op, seq, src, tail, t0};
}

void progress_leave(State *s, Progress *saved) {
    PyObject *set_meanwhile = s->progress.obj;
    s->progress = *saved;
    saved->obj = NULL;
    Py_XDECREF(set_meanwhile);
}

PyObject *progress_object(const Progress *p) {
    if (p->obj != NULL) return Py_NewRef(p->obj);
    if (p->phase == NULL) {
        PyErr_SetString(PyExc_AttributeError, "progress");
        return NULL;
    }
    static PyObject *minus_one;
    if (minus_one == NULL && (minus_one = PyLong_FromLong(-1)) == NULL) return NULL;
    Py_ssize_t n = 4;
    while (p->tail && p->tail[n - 4] != -2) n++;
    PyObject *t = PyTuple_New(n), *t0 = PyLong_FromLongLong(p->t0);
    if (t == NULL || t0 == NULL) {
        Py_XDECREF(t); Py_XDECREF(t0);
        return NULL;
    }
    PyTuple_SET_ITEM(t, 0, Py_NewRef(p->phase));
    PyTuple_SET_ITEM(t, 1, Py_NewRef(p->op));
    PyTuple_SET_ITEM(t, 2, Py_NewRef(p->seq));
    PyTuple_SET_ITEM(t, 3, t0);
    for (Py_ssize_t i = 4; i < n; i++) {
        int at = p->tail[i - 4];
        PyTuple_SET_ITEM(t, i, Py_NewRef(at < 0 ? minus_one : PyTuple_GET_ITEM(p->src, at)));
    }
    return t;
}

PyObject *progress_phase(const Progress *p) {
    if (p->obj == NULL) return p->phase;
    return PyTuple_Check(p->obj) && PyTuple_GET_SIZE(p->obj) > 0 ? PyTuple_GET_ITEM(p->obj, 0) : NULL;
}

static PyObject *State_get_progress(State *self, void *closure) { return progress_object(&self->progress); }

static int State_set_progress(State *self, PyObject *value, void *closure) {
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "progress cannot be deleted: set it to None");
        return -1;
    }
    Py_XSETREF(self->progress.obj, Py_NewRef(value));
    return 0;
}

static PyGetSetDef State_getset[] = {
    {"progress", (getter)State_get_progress, (setter)State_set_progress,
     "the sync point the rank is inside, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static void State_dealloc(State *self) {
    PyObject_GC_UnTrack(self);
    State_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define INT(name, doc) {#name, T_LONGLONG, offsetof(State, name), 0, doc},
#define OBJ(name, doc) {#name, T_OBJECT_EX, offsetof(State, name), 0, doc},
static PyMemberDef State_members[] = {
    STATE_INTS(INT)
    STATE_OBJECTS(OBJ)
    {NULL, 0, 0, 0, NULL},
};
#undef INT
#undef OBJ

PyTypeObject StateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.probes._fast.State",
    .tp_basicsize = sizeof(State),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The collector's per-event state, read and written by the C probes directly.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)State_dealloc,
    .tp_traverse = (traverseproc)State_traverse,
    .tp_clear = (inquiry)State_clear,
    .tp_members = State_members,
    .tp_getset = State_getset,
};

/* ``c`` as the state the C probes read: NULL where it is not one (a stand-in collector, the
 * module built without it): the caller goes the Python path. */
State *probe_state(PyObject *c) { return PyObject_TypeCheck(c, &StateType) ? (State *)c : NULL; }
