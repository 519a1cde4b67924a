/* The optimizer probe's step hooks in C, for the steady state of a training loop.
 *
 * torch calls the global step hooks around every optimizer step. In Python (probes/optimizer.py)
 * the pre and post hooks and the fingerprint's "is a check due?" took about 12 µs of a 0.7 ms
 * tiny step here, three Python frames in a step's context (benchmarks/probe_parts.py). These
 * objects do what the Python hooks do when nothing is unusual: no CUDA timer, the collector's
 * state as it declares it, the optimizer's name interned before. Anything else, before anything
 * is changed, goes to the Python hook (``slow``), which behaves as it always did; a fingerprint
 * check that is due or pending is the fingerprint module's ``after_step`` (looked up per call).
 */
#include "_fast.h"
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *slow;       /* the Python hook: slow(optimizer, args, kwargs) */
    PyObject *globals, *cuda_globals, *fp_globals; /* collector, cuda_timing, fingerprint dicts */
    PyObject *names;      /* type(optimizer) -> (writer, (interned name,)) */
    long long recorded;   /* steps recorded here, not by the Python hook (tests, benchmarks) */
    Global active, timer, fp; /* the globals read per call (_fast.h) */
} OptProbe;

static PyObject *s_intern, *s_name, *s_probe, *s_fp_probe, *s_c, *s_next_due,
    *s_checked, *s_pending, *s_stepped, *s_after_step;

static void OptProbe_dealloc(OptProbe *self) {
    Py_XDECREF(self->slow); Py_XDECREF(self->globals); Py_XDECREF(self->cuda_globals);
    Py_XDECREF(self->fp_globals); Py_XDECREF(self->names);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *pre_call(OptProbe *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames);
static PyObject *post_call(OptProbe *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames);

static int OptProbe_init(OptProbe *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"post", "slow", "globals", "cuda_globals", "fp_globals", NULL};
    int post;
    PyObject *o[4];
    if (!PyArg_ParseTupleAndKeywords(args, kw, "pOO!O!O!", names, &post, &o[0], &PyDict_Type, &o[1],
                                     &PyDict_Type, &o[2], &PyDict_Type, &o[3]))
        return -1;
    PyObject **fields[] = {&self->slow, &self->globals, &self->cuda_globals, &self->fp_globals};
    for (int i = 0; i < 4; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*fields[i], o[i]);
    }
    Py_XSETREF(self->names, PyDict_New());
    if (self->names == NULL) return -1;
    self->vectorcall = (vectorcallfunc)(post ? post_call : pre_call);
    return 0;
}

/* The collector when there is one to record into (a new reference), NULL with *plain set when
 * there is none (the hook does nothing), NULL without it when it is not a State (the Python
 * hook's) or on an error. */
static State *collector_state(OptProbe *self, int *plain) {
    PyObject *c = global_get(self->globals, s_active, &self->active);
    if (c == NULL || c == Py_None) {
        *plain = c == Py_None;
        return NULL;
    }
    State *s = probe_state(c);
    if (s == NULL || s->disabled == NULL || !PySet_Check(s->disabled) || s->optimizer_outer == NULL) return NULL;
    Py_INCREF(c);
    return s;
}

/* optimizer_outer() is not optimizer: 1, 0, or -1 on an error. */
static int other_step(PyObject *outer, PyObject *optimizer) {
    if (outer == Py_None) return 0;
    PyObject *current = PyObject_CallNoArgs(outer);
    if (current == NULL) return -1;
    Py_DECREF(current);
    return current != optimizer;
}

static PyObject *slow_call(OptProbe *self, PyObject *const *argv) {
    if (clear_own_error() < 0) return NULL; /* a signal handler's exception: the program's */
    return PyObject_Vectorcall(self->slow, argv, 3, NULL);
}

/* pre(optimizer, args, kwargs): the step's start, unless another optimizer's step is under way. */
static PyObject *pre_call(OptProbe *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames) return PyObject_Vectorcall(self->slow, argv, nargsf, kwnames);
    int plain = 0;
    State *s = collector_state(self, &plain);
    if (s == NULL) return plain ? Py_NewRef(Py_None) : slow_call(self, argv);
    PyObject *timer = global_get(self->cuda_globals, s_active, &self->timer);
    if (timer != Py_None) goto slow;
    if (s->optimizer_t0) {
        int other = other_step(s->optimizer_outer, argv[0]);
        if (other < 0) goto slow;
        if (other) goto none; /* inside another optimizer's step: not a step of its own */
    }
    PyObject *ref = PyWeakref_NewRef(argv[0], NULL);
    if (ref == NULL) goto slow;
    Py_XSETREF(s->optimizer_outer, ref);
    s->optimizer_t0 = now_ns();
none:
    Py_DECREF(s);
    return Py_NewRef(Py_None);
slow:
    Py_DECREF(s);
    return slow_call(self, argv);
}

/* The record's fields, (the optimizer's name interned,): cached per type and writer. */
static PyObject *name_fields(OptProbe *self, PyObject *optimizer, PyObject *writer) {
    PyObject *type = (PyObject *)Py_TYPE(optimizer);
    PyObject *known = PyDict_GetItemWithError(self->names, type);
    if (known != NULL && PyTuple_GET_ITEM(known, 0) == writer) return Py_NewRef(PyTuple_GET_ITEM(known, 1));
    if (PyErr_Occurred()) return NULL;
    PyObject *name = PyObject_GetAttr(type, s_name);
    PyObject *sid = name ? PyObject_CallMethodOneArg(writer, s_intern, name) : NULL;
    PyObject *fields = sid ? PyTuple_Pack(1, sid) : NULL;
    PyObject *entry = fields ? PyTuple_Pack(2, writer, fields) : NULL;
    if (entry == NULL || PyDict_SetItem(self->names, type, entry) < 0) Py_CLEAR(fields);
    Py_XDECREF(entry); Py_XDECREF(sid); Py_XDECREF(name);
    return fields;
}

/* After the record: the fingerprint's after_step when a check is due or pending, else only its
 * note of the step (fingerprint.py's Fingerprints.after_step, its cheap path); 0, or -1 when a
 * signal handler's exception must go on. */
static int fingerprint(OptProbe *self, State *s, PyObject *disabled, PyObject *optimizer) {
    PyObject *fp = global_get(self->fp_globals, s_active, &self->fp);
    PyObject *fd = fp && fp != Py_None ? PyObject_GenericGetDict(fp, NULL) : NULL;
    if (fd == NULL) goto out;
    PyObject *owner = PyDict_GetItemWithError(fd, s_c);
    if (owner != (PyObject *)s || PySet_Contains(disabled, s_fp_probe)) goto out;
    PyObject *due_at = PyDict_GetItemWithError(fd, s_next_due);
    PyObject *checked = PyDict_GetItemWithError(fd, s_checked), *pending = PyDict_GetItemWithError(fd, s_pending);
    int bad = due_at == NULL || checked == NULL || pending == NULL;
    int64_t now_step = s->step;
    int due = !bad && (now_step >= as_i64(due_at, &bad) || now_step == as_i64(checked, &bad));
    int waiting = bad ? -1 : PyObject_IsTrue(pending);
    if (bad || waiting < 0 || due || waiting) { /* the module's after_step: it guards and logs */
        PyErr_Clear();
        PyObject *after = PyDict_GetItemWithError(self->fp_globals, s_after_step);
        PyObject *r = after ? PyObject_CallFunctionObjArgs(after, (PyObject *)s, optimizer, NULL) : NULL;
        Py_XDECREF(r);
    } else {
        PyObject *step = PyLong_FromLongLong(now_step);
        if (step != NULL) PyDict_SetItem(fd, s_stepped, step);
        Py_XDECREF(step);
    }
out:
    Py_XDECREF(fd);
    return clear_own_error(); /* after_step logs its own errors; ours are not the patient's */
}

/* post(optimizer, args, kwargs): the step's record, once per outer step, then the fingerprint. */
static PyObject *post_call(OptProbe *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames) return PyObject_Vectorcall(self->slow, argv, nargsf, kwnames);
    PyObject *optimizer = argv[0];
    int plain = 0;
    State *s = collector_state(self, &plain);
    if (s == NULL) return plain ? Py_NewRef(Py_None) : slow_call(self, argv);
    PyObject *fields = NULL, *result = Py_None;
    PyObject *held = Py_NewRef(s->disabled); /* across the writer's intern: Python code */
    int off = PySet_Contains(held, s_probe);
    int64_t t0 = s->optimizer_t0;
    if (off < 0) goto slow;
    if (off || t0 == 0) goto done;
    int other = other_step(s->optimizer_outer, optimizer);
    if (other < 0) goto slow;
    if (other) goto done; /* an inner optimizer's step: the outer one's post hook records it */
    PyObject *timer = global_get(self->cuda_globals, s_active, &self->timer);
    PyObject *writer = timer == Py_None ? s->writer : NULL;
    if (writer == NULL || (fields = name_fields(self, optimizer, writer)) == NULL) goto slow;

    /* Nothing unusual: the record, as the Python hook makes it. */
    s->optimizer_t0 = 0;
    set_field(&s->optimizer_outer, Py_None);
    pack_event(s, s->optimizer_kind, t0, now_ns(), fields);
    self->recorded++;
    if (clear_own_error() < 0) {
        result = NULL;
        goto done;
    }
    if (fingerprint(self, s, held, optimizer) < 0) result = NULL; /* a signal handler's */
    goto done;
slow:
    Py_XDECREF(fields); Py_DECREF(held); Py_DECREF(s);
    return slow_call(self, argv);
done:
    Py_XDECREF(fields); Py_DECREF(held); Py_DECREF(s);
    return Py_XNewRef(result);
}

static PyMemberDef OptProbe_members[] = {
    {"recorded", T_LONGLONG, offsetof(OptProbe, recorded), READONLY, "steps recorded in C"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject OptProbeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.probes._fast.OptimizerProbe",
    .tp_basicsize = sizeof(OptProbe),
    .tp_vectorcall_offset = offsetof(OptProbe, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "The optimizer probe's pre or post step hook, steady state (see probes/optimizer.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)OptProbe_init,
    .tp_dealloc = (destructor)OptProbe_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_members = OptProbe_members,
};

int opt_init(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1
    INTERN(s_intern, "intern"); INTERN(s_name, "__name__"); INTERN(s_probe, "optimizer");
    INTERN(s_fp_probe, "fingerprint"); INTERN(s_c, "c"); INTERN(s_next_due, "next_due"); INTERN(s_checked, "checked");
    INTERN(s_pending, "pending"); INTERN(s_stepped, "stepped"); INTERN(s_after_step, "after_step");
#undef INTERN
    return PyType_Ready(&OptProbeType);
}
