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
    return 0;
}

static int State_clear(State *self) {
#define CLEAR(name, doc) Py_CLEAR(self->name);
    STATE_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

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
};

/* ``c`` as the state the C probes read: NULL where it is not one (a stand-in collector, the
 * module built without it): the caller goes the Python path. */
State *probe_state(PyObject *c) { return PyObject_TypeCheck(c, &StateType) ? (State *)c : NULL; }
