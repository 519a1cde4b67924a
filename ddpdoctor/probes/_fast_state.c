/* State: the part of the collector (probes/collector.py) that the probes read and write on
 * every event, as the fields of one C object, the collector's base class.
 *
 * As instance attributes these lived in the collector's dict: a probe's read was a dict lookup
 * (about 120 instructions) and its write a dict store (about 200), some twenty of each per
 * tiny step. As members they are a load and a store, and Python reads and writes them as it
 * did, through member descriptors. The counters and times are C integers (Python sees ints);
 * everything else is any object, as before. A field never set reads as AttributeError.
 */
#include "_fast.h"
#include <structmember.h>

static int State_traverse(State *self, visitproc visit, void *arg) {
    Py_VISIT(self->progress); Py_VISIT(self->disabled); Py_VISIT(self->writer); Py_VISIT(self->in_bucket_hook);
    Py_VISIT(self->awaiting_backward); Py_VISIT(self->accumulating); Py_VISIT(self->step_model);
    Py_VISIT(self->pace_model); Py_VISIT(self->native_step); Py_VISIT(self->native_settling);
    Py_VISIT(self->default_pg); Py_VISIT(self->optimizer_outer); Py_VISIT(self->calls);
    Py_VISIT(self->collective_kind); Py_VISIT(self->forward_kind); Py_VISIT(self->backward_kind);
    Py_VISIT(self->optimizer_kind);
    return 0;
}

static int State_clear(State *self) {
    Py_CLEAR(self->progress); Py_CLEAR(self->disabled); Py_CLEAR(self->writer); Py_CLEAR(self->in_bucket_hook);
    Py_CLEAR(self->awaiting_backward); Py_CLEAR(self->accumulating); Py_CLEAR(self->step_model);
    Py_CLEAR(self->pace_model); Py_CLEAR(self->native_step); Py_CLEAR(self->native_settling);
    Py_CLEAR(self->default_pg); Py_CLEAR(self->optimizer_outer); Py_CLEAR(self->calls);
    Py_CLEAR(self->collective_kind); Py_CLEAR(self->forward_kind); Py_CLEAR(self->backward_kind);
    Py_CLEAR(self->optimizer_kind);
    return 0;
}

static void State_dealloc(State *self) {
    PyObject_GC_UnTrack(self);
    State_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define OBJ(name, doc) {#name, T_OBJECT_EX, offsetof(State, name), 0, doc}
#define INT(name, doc) {#name, T_LONGLONG, offsetof(State, name), 0, doc}
static PyMemberDef State_members[] = {
    INT(step, "the training step (-1 before the first)"),
    INT(events, "events recorded so far: the counter liveness watches move"),
    INT(last_step_ns, "entry of the last training forward"),
    INT(max_step_ns, "the slowest step seen"),
    INT(optimizer_t0, "the running optimizer step's start, 0 when none"),
    OBJ(progress, "the sync point the rank is inside, or None"),
    OBJ(disabled, "the probes switched off"),
    OBJ(writer, "the trace writer"),
    OBJ(in_bucket_hook, "inside a gradient bucket's comm hook"),
    OBJ(awaiting_backward, "a grad-mode DDP forward has not had its backward yet"),
    OBJ(accumulating, "the pace model's last forward ran under no_sync()"),
    OBJ(step_model, "the DDP model state of the last grad-mode forward"),
    OBJ(pace_model, "the model whose grad-mode forwards count steps"),
    OBJ(native_step, "the C++ timer's set_step, or None"),
    OBJ(native_settling, "drain the C++ timer after each backward"),
    OBJ(default_pg, "the default process group"),
    OBJ(optimizer_outer, "weakref to the optimizer whose step began, or None"),
    OBJ(calls, "per call site and tensor shape, what a collective's records share"),
    OBJ(collective_kind, "the collective's record kind"),
    OBJ(forward_kind, "the DDP forward's record kind"),
    OBJ(backward_kind, "the DDP backward's record kind"),
    OBJ(optimizer_kind, "the optimizer step's record kind"),
    {NULL, 0, 0, 0, NULL},
};
#undef OBJ
#undef INT

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
