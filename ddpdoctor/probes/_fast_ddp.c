/* The DDP forward and backward probes in C, for the steady state of a training loop.
 *
 * In a step's context (caches cold after autograd's C++ and the optimizer ran) each line of a
 * probe's Python costs several times what it costs in a warm loop: the forward probe took
 * about 23 µs and the backward probe 16 µs of its own (besides the drain, the run-queue read
 * and the unused check) on a 0.7 ms step here (benchmarks/probe_parts.py). The patched
 * functions stay Python (a method must bind, torch.compile must see a function) and hand their
 * arguments to these objects, which do what probes/ddp.py's Python path does when nothing is
 * unusual: a model whose state, group and bucket timing are known, a call site learnt before,
 * no CUDA timer. Anything else, before anything is changed, goes to that path, ``slow``; a
 * probe that breaks before the call logs once and switches off (``failed``), as in Python.
 */
#include "_fast.h"
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *orig;     /* DistributedDataParallel.forward, or torch.autograd.backward */
    PyObject *slow;     /* the Python path: slow(*args, **kwargs) */
    PyObject *failed;   /* failed(collector, exc): the probe broke before the call */
    PyObject *raised;   /* raised(collector, prev, state, fields, exc): a call that raised */
    PyObject *helpers;  /* forward: (); backward: (drain_settling, check_unused, note_unused) */
    PyObject *globals, *cuda_globals, *site_globals; /* collector, cuda_timing, callsite dicts */
    PyObject *grad_enabled; /* torch.is_grad_enabled */
    PyObject *phase, *op, *op_eval, *state_attr;
    int depth;
    SiteMemo site; /* the forward's last call site */
    Global active, timer, owner, calls, is_user; /* the globals read per call (_fast.h) */
    long long recorded; /* calls recorded here, not by the Python path (tests, benchmarks) */
} DdpProbe;

static PyObject *small_ints[2]; /* 0 and 1: the forward record's grad and training fields */
static PyObject *s_sync_flag, *s_training, *s_group_named, *s_seq_of, *s_registered, *s_untimed, *s_owner,
    *s_calls_dict, *s_is_user, *s_ddp;

static void DdpProbe_dealloc(DdpProbe *self) {
    Py_XDECREF(self->orig); Py_XDECREF(self->slow); Py_XDECREF(self->failed); Py_XDECREF(self->raised);
    Py_XDECREF(self->helpers); Py_XDECREF(self->globals); Py_XDECREF(self->cuda_globals);
    Py_XDECREF(self->site_globals); Py_XDECREF(self->grad_enabled); Py_XDECREF(self->phase);
    Py_XDECREF(self->op); Py_XDECREF(self->op_eval); Py_XDECREF(self->state_attr);
    memo_clear(&self->site);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *forward_call(DdpProbe *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames);
static PyObject *backward_call(DdpProbe *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames);

static int DdpProbe_init(DdpProbe *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"backward", "orig", "slow", "failed", "raised", "helpers", "globals",
                            "cuda_globals", "site_globals", "grad_enabled", "phase", "op", "op_eval",
                            "state_attr", "depth", NULL};
    int backward, depth;
    PyObject *o[13];
    if (!PyArg_ParseTupleAndKeywords(args, kw, "pOOOOO!O!O!O!OOUOUi", names, &backward, &o[0], &o[1], &o[2],
                                     &o[3], &PyTuple_Type, &o[4], &PyDict_Type, &o[5], &PyDict_Type, &o[6], &PyDict_Type,
                                     &o[7], &o[8], &o[9], &o[10], &o[11], &o[12], &depth))
        return -1;
    PyObject **fields[] = {&self->orig, &self->slow, &self->failed, &self->raised, &self->helpers,
                           &self->globals, &self->cuda_globals, &self->site_globals, &self->grad_enabled,
                           &self->phase, &self->op, &self->op_eval, &self->state_attr};
    for (int i = 0; i < 13; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*fields[i], o[i]);
    }
    self->depth = depth;
    self->vectorcall = (vectorcallfunc)(backward ? backward_call : forward_call);
    return 0;
}

/* module.<name> (a new reference, or NULL with AttributeError set), read from the module's dict
 * (``md``) where it is there, else by the generic lookup. nn.Module's __getattr__ makes every
 * generic lookup two type lookups and a call, about 750 instructions, where a dict lookup is
 * about 120. The same value: the dict holds the name only where nn.Module's __setattr__ put it,
 * which a class-level descriptor of that name would have taken instead. */
static PyObject *module_attr(PyObject *module, PyObject *md, PyObject *name) {
    PyObject *v = PyDict_GetItemWithError(md, name);
    if (v != NULL) return Py_NewRef(v);
    if (PyErr_Occurred()) return NULL;
    return PyObject_GetAttr(module, name);
}

/* The probe broke before the call: failed(c, exc) logs it and switches the probe off (or
 * re-raises what a signal handler raised); -1 then, else the caller runs the call plainly. */
static int broke(DdpProbe *self, PyObject *c) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1; /* KeyboardInterrupt: the program's */
    Raised e = fetch();
    PyObject *r = PyObject_CallFunctionObjArgs(self->failed, c, e.value ? e.value : Py_None, NULL);
    Py_XDECREF(e.type); Py_XDECREF(e.value); Py_XDECREF(e.tb);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* The call raised: raised(c, prev, state, fields, exc) records it; the patient's exception
 * goes on, unchanged, whatever happens there. */
static void on_raise(DdpProbe *self, State *s, Progress *saved, PyObject *state, PyObject *fields) {
    Raised e = fetch();
    PyObject *prev = progress_object(saved);
    PyObject *r = prev ? PyObject_CallFunctionObjArgs(self->raised, (PyObject *)s, prev, state, fields,
                                                      e.value ? e.value : Py_None, NULL)
                       : NULL;
    if (r == NULL) PyErr_Clear();
    Py_XDECREF(r);
    Py_XDECREF(prev);
    progress_leave(s, saved); /* what raised() set, or what it could not */
    PyErr_Restore(e.type, e.value, e.tb);
}

/* forward_(self, inputs, kwargs): DistributedDataParallel.forward(self, *inputs, **kwargs). */
static PyObject *forward_call(DdpProbe *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames || !PyTuple_Check(argv[1]) || !PyDict_Check(argv[2])) {
        PyErr_SetString(PyExc_TypeError, "forward probe(module, inputs: tuple, kwargs: dict)");
        return NULL;
    }
    PyObject *module = argv[0], *inputs = argv[1], *kwargs = PyDict_GET_SIZE(argv[2]) ? argv[2] : NULL;
    Py_ssize_t n_in = PyTuple_GET_SIZE(inputs);
    PyObject *stack_args[8], **call_args = n_in < 8 ? stack_args : PyMem_Malloc((n_in + 1) * sizeof(PyObject *));
    if (call_args == NULL) return PyErr_NoMemory();
    call_args[0] = module;
    for (Py_ssize_t i = 0; i < n_in; i++) call_args[i + 1] = PyTuple_GET_ITEM(inputs, i);

    PyObject *c = global_get(self->globals, s_active, &self->active), *result = NULL;
    PyObject *md = NULL, *sd = NULL, *state = NULL, *grad_obj = NULL, *site = NULL, *seq = NULL;
    PyObject *fields = NULL;
    Progress saved;
    if (c == NULL || c == Py_None) {
        c = NULL; /* borrowed: not ours to let go at the end */
        if (PyErr_Occurred()) goto fail;
        goto plain;
    }
    Py_INCREF(c);
    State *s = probe_state(c);
    if (s == NULL || s->disabled == NULL || !PySet_Check(s->disabled) || progress_unset(&s->progress)) goto slow;
    int off = PySet_Contains(s->disabled, s_ddp);
    if (off) goto plain_or_broken;
    PyObject *timer = global_get(self->cuda_globals, s_active, &self->timer);
    if (timer != Py_None) goto slow_or_broken; /* device spans: the Python path's */
    if ((grad_obj = PyObject_CallNoArgs(self->grad_enabled)) == NULL) goto broken;
    int grad = PyObject_IsTrue(grad_obj);
    if (grad < 0) goto broken;
    if ((md = PyObject_GenericGetDict(module, NULL)) == NULL) goto broken;
    state = PyDict_GetItemWithError(md, self->state_attr);
    if (state == NULL || state == Py_None) goto slow_or_broken;
    Py_INCREF(state);
    if ((sd = PyObject_GenericGetDict(state, NULL)) == NULL) goto broken;
    PyObject *named = PyDict_GetItemWithError(sd, s_group_named);
    if (named == NULL || !PyTuple_Check(named) || PyTuple_GET_SIZE(named) != 3) goto slow_or_broken;
    PyObject *pace = s->pace_model;
    if (grad) {
        PyObject *registered = PyDict_GetItemWithError(sd, s_registered);
        PyObject *untimed = registered ? PyDict_GetItemWithError(sd, s_untimed) : NULL;
        if (pace == NULL || pace == Py_None || untimed == NULL || s->accumulating == NULL) goto slow_or_broken;
        if (!PyObject_IsTrue(registered) && !PyObject_IsTrue(untimed)) goto slow; /* the timer goes in now */
    }
    /* the call site, learnt before (callsite.py), from the wrapper's caller on */
    PyObject *owner = global_get(self->site_globals, s_owner, &self->owner);
    PyObject *calls = global_get(self->site_globals, s_calls_dict, &self->calls);
    PyObject *is_user = global_get(self->site_globals, s_is_user, &self->is_user);
    if (owner == NULL || !PyList_Check(owner) || PyList_GET_SIZE(owner) < 1 || PyList_GET_ITEM(owner, 0) != c ||
        calls == NULL || is_user == NULL)
        goto slow_or_broken;
    Frame frame;
    site = frame_caller(&frame, self->depth) == 0 ? site_memo(&self->site, c, &frame, calls, is_user) : NULL;
    frame_done(&frame);
    if (site == NULL) goto broken;
    if (site == Py_None) goto slow; /* a site not learnt yet: the Python path walks and learns it */
    PyObject *seq_of = PyDict_GetItemWithError(sd, s_seq_of);
    PyObject *group = seq_of ? PyDict_GetItemWithError(sd, s_group) : NULL;
    if (group == NULL || (seq = seq_now(group, seq_of)) == NULL) goto slow_or_broken;
    PyObject *training = module_attr(module, md, s_training);
    int train = training ? PyObject_IsTrue(training) : -1;
    Py_XDECREF(training);
    if (train < 0) goto broken;
    if (grad && state == pace && s->step + 1 >= s->inputs_at) { /* a step whose inputs are counted */
        int accumulating = PyObject_IsTrue(s->accumulating);
        if (accumulating < 0) goto broken;
        if (!accumulating) goto slow;
    }

    /* Nothing unusual: the step's bookkeeping, as the Python path does it. */
    int new_step = 0;
    if (grad) {
        int accumulating = PyObject_IsTrue(s->accumulating);
        if (accumulating < 0) goto broken;
        new_step = state == pace && !accumulating;
        if (new_step) {
            s->step++;
            PyObject *stamp = s->native_step; /* the C++ timer's: its writer where it was handed over */
            if (stamp != NULL && stamp != Py_None && step_writer != NULL) {
                step_writer(s->step);
            } else if (stamp != NULL && stamp != Py_None) {
                PyObject *next = PyLong_FromLongLong(s->step);
                PyObject *r = next ? PyObject_CallOneArg(stamp, next) : NULL;
                Py_XDECREF(next);
                if (r == NULL) goto broken;
                Py_DECREF(r);
            }
        }
        if (state == pace) { /* micro-batches under no_sync() share one optimizer step */
            PyObject *sync = module_attr(module, md, s_sync_flag);
            if (sync == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear();
                sync = Py_NewRef(Py_True);
            }
            int syncs = sync ? PyObject_IsTrue(sync) : -1;
            Py_XDECREF(sync);
            if (syncs < 0) goto broken;
            set_field(&s->accumulating, syncs ? Py_False : Py_True);
        }
        set_field(&s->awaiting_backward, Py_True);
        set_field(&s->step_model, state);
    }
    int64_t t0 = now_ns();
    if (new_step) {
        if (s->last_step_ns && t0 - s->last_step_ns > s->max_step_ns) s->max_step_ns = t0 - s->last_step_ns;
        s->last_step_ns = t0;
    }
    fields = PyTuple_Pack(4, small_ints[grad], small_ints[train], seq, site);
    if (fields == NULL) goto broken;
    /* the live status: (phase, op, seq, t0, gname, gsize, -1, pg); ``named`` is the state's
     * (pg, gname, gsize), held here: the state's dict may drop it while the model runs */
    static const signed char tail[] = {1, 2, -1, 0, -2};
    Py_INCREF(named);
    progress_enter(s, &saved, self->phase, grad ? self->op : self->op_eval, seq, named, tail, t0);

    result = PyObject_VectorcallDict(self->orig, call_args, n_in + 1, kwargs);
    if (result == NULL) {
        on_raise(self, s, &saved, state, fields);
        Py_DECREF(named);
        goto done;
    }
    int64_t t1 = now_ns();
    progress_leave(s, &saved);
    Py_DECREF(named);
    pack_event(s, s->forward_kind, t0, t1, fields);
    if (clear_own_error() < 0) Py_CLEAR(result); /* a signal handler's exception: the program's */
    self->recorded++;
    goto done;

plain_or_broken:
    if (PyErr_Occurred()) goto broken;
    goto plain;
slow_or_broken:
    if (!PyErr_Occurred()) goto slow;
broken:
    if (broke(self, c) < 0) goto fail;
plain:
    result = PyObject_VectorcallDict(self->orig, call_args, n_in + 1, kwargs);
    goto done;
slow:
    result = PyObject_VectorcallDict(self->slow, call_args, n_in + 1, kwargs);
    goto done;
fail:
    result = NULL;
done:
    Py_XDECREF(fields); Py_XDECREF(seq);
    Py_XDECREF(site); Py_XDECREF(sd); Py_XDECREF(state); Py_XDECREF(md); Py_XDECREF(grad_obj);
    Py_XDECREF(c);
    if (call_args != stack_args) PyMem_Free(call_args);
    return result;
}

/* backward_(args, kwargs): torch.autograd.backward(*args, **kwargs). */
static PyObject *backward_call(DdpProbe *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 2 || kwnames || !PyTuple_Check(argv[0]) || !PyDict_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "backward probe(args: tuple, kwargs: dict)");
        return NULL;
    }
    PyObject *args = argv[0], *kwargs = PyDict_GET_SIZE(argv[1]) ? argv[1] : NULL;
    PyObject *c = global_get(self->globals, s_active, &self->active), *result = NULL;
    PyObject *seq = NULL;
    Progress saved;
    if (c == NULL || c == Py_None) {
        if (PyErr_Occurred()) return NULL;
        return PyObject_Call(self->orig, args, kwargs);
    }
    Py_INCREF(c);
    State *s = probe_state(c);
    if (s == NULL || s->awaiting_backward == NULL || s->disabled == NULL || !PySet_Check(s->disabled) ||
        progress_unset(&s->progress))
        goto slow;
    int waits = PyObject_IsTrue(s->awaiting_backward);
    if (waits <= 0 || PySet_Contains(s->disabled, s_ddp)) goto plain_or_broken;
    PyObject *timer = global_get(self->cuda_globals, s_active, &self->timer);
    if (timer != Py_None) goto slow_or_broken;
    if (s->default_pg == NULL || (seq = seq_now(s->default_pg, NULL)) == NULL) {
        if (clear_own_error() < 0) goto done; /* else the Python path reads it as -1 */
        goto slow;
    }
    set_field(&s->awaiting_backward, Py_False);
    int64_t t0 = now_ns();
    static const signed char tail[] = {-2}; /* the live status: (phase, op, seq, t0) */
    progress_enter(s, &saved, self->phase, self->op, seq, NULL, tail, t0);

    result = PyObject_Call(self->orig, args, kwargs);
    if (result == NULL) {
        on_raise(self, s, &saved, Py_None, Py_None);
        goto done;
    }
    self->recorded++;
    after_backward(s, &saved, t0, self->helpers);
    if (PyErr_Occurred()) Py_CLEAR(result); /* a signal handler's exception: the program's */
    goto done;

plain_or_broken:
    if (PyErr_Occurred()) goto broken;
    result = PyObject_Call(self->orig, args, kwargs);
    goto done;
slow_or_broken:
    if (!PyErr_Occurred()) goto slow;
broken:
    if (broke(self, c) < 0) goto done;
    result = PyObject_Call(self->orig, args, kwargs);
    goto done;
slow:
    result = PyObject_Call(self->slow, args, kwargs);
done:
    Py_XDECREF(seq); Py_DECREF(c);
    return result;
}

static PyMemberDef DdpProbe_members[] = {
    {"recorded", T_LONGLONG, offsetof(DdpProbe, recorded), READONLY, "calls recorded in C"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject DdpProbeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.probes._fast.DdpProbe",
    .tp_basicsize = sizeof(DdpProbe),
    .tp_vectorcall_offset = offsetof(DdpProbe, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "The DDP forward or backward probe's steady state (see probes/ddp.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)DdpProbe_init,
    .tp_dealloc = (destructor)DdpProbe_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_members = DdpProbe_members,
};

int ddp_init(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1
    INTERN(s_sync_flag, "require_backward_grad_sync"); INTERN(s_training, "training");
    INTERN(s_group_named, "group_named"); INTERN(s_seq_of, "seq_of"); INTERN(s_registered, "timer_registered");
    INTERN(s_untimed, "untimed"); INTERN(s_owner, "_owner");
    INTERN(s_calls_dict, "_calls"); INTERN(s_is_user, "_is_user"); INTERN(s_ddp, "ddp");
#undef INTERN
    if ((small_ints[0] = PyLong_FromLong(0)) == NULL ||
        (small_ints[1] = PyLong_FromLong(1)) == NULL)
        return -1;
    return PyType_Ready(&DdpProbeType);
}
