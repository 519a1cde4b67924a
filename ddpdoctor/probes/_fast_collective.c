/* The collective probe in C: see _fast.c for what it does and when it runs. */
#include "_fast_collective.h"

static PyObject *Collective_vectorcall(Collective *self, PyObject *const *argv, size_t nargsf,
                                       PyObject *kwnames);

static void Collective_dealloc(Collective *self) {
    Py_XDECREF(self->orig); Py_XDECREF(self->slow); Py_XDECREF(self->failed);
    Py_XDECREF(self->of_frame); Py_XDECREF(self->globals); Py_XDECREF(self->tensor);
    Py_XDECREF(self->phase); Py_XDECREF(self->op); Py_XDECREF(self->kind); Py_XDECREF(self->root_names);
    Py_XDECREF(self->last_c); Py_XDECREF(self->last_known); Py_XDECREF(self->last_code);
    Py_XDECREF(self->last_group); Py_XDECREF(self->last_dtype); Py_XDECREF(self->image_of);
    Py_XDECREF(self->kid_c); Py_XDECREF(self->compiler);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Collective_init(Collective *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"orig", "slow", "failed", "of_frame", "globals", "compiler", "tensor", "phase",
                            "op", "kind", "fmt", "always_async", "root_pos", "root_names",
                            "root_default", "depth", NULL};
    PyObject *orig, *slow, *failed, *of_frame, *globals, *compiler, *tensor, *phase, *op, *kind, *root_names;
    const char *fmt;
    int always_async, root_pos, root_default, depth;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO!O!OOUUspiOii", names, &orig, &slow, &failed,
                                     &of_frame, &PyDict_Type, &globals, &PyDict_Type, &compiler, &tensor,
                                     &phase, &op, &kind, &fmt, &always_async, &root_pos, &root_names,
                                     &root_default, &depth))
        return -1;
    if (parse_format(&self->layout, fmt) < 0 || self->layout.ncodes != 13 ||
        self->layout.codes[12] != 'Q' || self->layout.size > RING_SLOT) {
        PyErr_Format(PyExc_ValueError, "unsupported record format %s", fmt);
        return -1;
    }
    if (root_names != Py_None && !PyTuple_Check(root_names)) {
        PyErr_SetString(PyExc_TypeError, "root_names: a tuple or None");
        return -1;
    }
#define SET(field, value) do { Py_INCREF(value); Py_XSETREF(self->field, value); } while (0)
    SET(orig, orig); SET(slow, slow); SET(failed, failed); SET(of_frame, of_frame);
    SET(globals, globals); SET(compiler, compiler); SET(tensor, tensor); SET(phase, phase); SET(op, op); SET(kind, kind);
    SET(root_names, root_names);
#undef SET
    self->always_async = always_async;
    self->root_pos = root_pos;
    self->root_default = root_default;
    self->depth = depth;
    self->vectorcall = (vectorcallfunc)Collective_vectorcall;
    return 0;
}

/* 0 when the record can be written: the state's ring (ring_held, which the other C probes
 * share) and the kind id known; -1 when there is nothing to write to. */
static inline int ring_now(Collective *self, State *s) {
    if ((PyObject *)s != self->kid_c && coll_kid_find(self, s) < 0) return -1;
    return ring_held(s);
}

/* The record of a call that returned, into the ring's next slot (the Python path's inlined
 * pack): the ring found before the call (one closed since counts the record lost). */
static void record(Collective *self, State *s, PyObject *known, Value seq, int seq_bad, PyObject *site_obj,
                   int async_, int64_t t0, int64_t t1) {
    /* over the call site's image: kind id, step, t0, t1, then of the fields in schema.COLLECTIVE's
     * order (op, bytes, group, group size, seq, async, site, signature) seq, async and a site
     * found by walking */
    static const int vary[] = {0, 1, 2, 3, 8, 9, -1}, vary_site[] = {0, 1, 2, 3, 8, 9, 10, -1};
    _Alignas(8) char own[RING_SLOT];
    const char *image = self->image;
    int bad = self->image_bad || seq_bad;
    if (known != self->image_of) { /* another thread's call site was cached while this call ran */
        long long sid, site;
        int ids_bad;
        bad = coll_image_from(&self->layout, known, own, &sid, &site, &ids_bad) || seq_bad;
        image = own;
    }
    Value values[7];
    values[0].i = self->kid;
    values[1].i = s->step;
    values[2].i = t0;
    values[3].i = t1;
    values[4] = seq;
    values[5].i = async_;
    int walked = site_obj != PyTuple_GET_ITEM(known, 8);
    if (walked) values[6] = as_value(site_obj, self->layout.codes[10], &bad);
    put_image(&s->pack.ring, &self->layout, image, walked ? vary_site : vary, values, bad);
}

static PyObject *passthrough(Collective *self, PyObject *args, PyObject *kwargs) {
    return PyObject_Call(self->orig, args, kwargs);
}

/* What the Python path described this call as (a new reference), or NULL: a new call site
 * (no error set), or an error. The last call site is compared by value first. */
static PyObject *known_call(Collective *self, PyObject *c, PyObject *calls, const Frame *frame, PyObject *head,
                            PyObject *group, int async_, long long root) {
    PyObject *code = frame_code(frame); /* borrowed */
    int lasti = frame_lasti(frame);
    PyObject *dtype = NULL, *known = NULL;
    int64_t nb;
    if (tensor_now(head, &dtype, &nb) < 0) goto out;
    if (self->last_known && c == self->last_c && code == self->last_code &&
        lasti == self->last_lasti && group == self->last_group && async_ == self->last_async &&
        root == self->last_root && dtype == self->last_dtype && nb == self->last_nbytes) {
        known = self->last_known;
        Py_INCREF(known);
        goto out;
    }
    known = coll_learn_call(self, c, calls, code, lasti, group, async_, root, dtype, nb);
out:
    Py_XDECREF(dtype);
    return known;
}

/* fast(args, kwargs): the Python wrapper's (*args, **kwargs), as they came. */
static PyObject *Collective_vectorcall(Collective *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 2 || kwnames != NULL || !PyTuple_Check(argv[0]) ||
        !PyDict_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "Collective(args: tuple, kwargs: dict)");
        return NULL;
    }
    PyObject *args = argv[0], *kwargs = PyDict_GET_SIZE(argv[1]) ? argv[1] : NULL;
    PyObject *c = global_get(self->globals, s_active, &self->active); /* borrowed */
    if (c == NULL || c == Py_None) {
        if (PyErr_Occurred()) return NULL;
        return passthrough(self, args, kwargs);
    }
    Py_INCREF(c);
    PyObject *known = NULL, *site_obj = NULL, *seq_obj = NULL;
    Frame frame = {0};
    PyObject *result = NULL, *group = Py_None;
    Progress saved;
    int async_ = self->always_async;
    long long root = -1;

    State *s = probe_state(c);
    if (s == NULL || s->in_bucket_hook == NULL || s->disabled == NULL || !PySet_Check(s->disabled) ||
        progress_unset(&s->progress))
        goto slow;
    if (PyObject_IsTrue(s->in_bucket_hook) != 0 ||
        (PySet_GET_SIZE(s->disabled) && PySet_Contains(s->disabled, s_collectives) != 0))
        goto plain;
    /* torch.export's tracing (torch.compiler.is_compiling()): torch's call alone, as the Python
     * path does; Dynamo's is the Python wrapper's to see */
    PyObject *compiling = global_get(self->compiler, s_compiling_flag, &self->compiling);
    if (compiling == Py_True) goto plain;
    if (compiling == NULL && PyErr_Occurred()) goto broken;
    if (progress_phase(&s->progress) == self->phase) goto plain; /* inside a recorded collective: part of it */

    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (kwargs) {
        PyObject *g = PyDict_GetItemWithError(kwargs, s_group);
        if (g) group = g;
        else if (PyErr_Occurred()) goto broken;
        if (!async_) {
            PyObject *a = PyDict_GetItemWithError(kwargs, s_async_op);
            if (a) {
                if ((async_ = PyObject_IsTrue(a)) < 0) goto broken;
            } else if (PyErr_Occurred()) goto broken;
        }
    }
    if (group == Py_None && nargs > 1) {
        for (Py_ssize_t i = 0; i < nargs; i++)
            if (coll_is_group(PyTuple_GET_ITEM(args, i))) { group = PyTuple_GET_ITEM(args, i); break; }
    }
    if (self->root_names != Py_None && (root = coll_root_of(self, args, kwargs)) == -2 && PyErr_Occurred())
        goto broken;
    if (nargs < 1) goto slow;
    PyObject *head = PyTuple_GET_ITEM(args, 0);
    int is_tensor = PyObject_IsInstance(head, self->tensor);
    if (is_tensor <= 0) goto broken_or_slow;

    if (frame_caller(&frame, self->depth) < 0) goto slow;
    known = known_call(self, c, s->calls, &frame, head, group, async_, root);
    if (known == NULL) goto broken_or_slow; /* a new call site: the Python path describes it */
    /* (pg, gname, gsize, nbytes, sig, op_id, gid, async, site, sid, seq_of, walk, code) */
    site_obj = PyTuple_GET_ITEM(known, 8);
    Py_INCREF(site_obj);
    int walk = PyObject_IsTrue(PyTuple_GET_ITEM(known, 11));
    if (walk < 0) goto broken;
    if (walk) { /* called from a library: whose line called it varies */
        PyFrameObject *user = frame_object(&frame);
        PyObject *found = user ? PyObject_CallFunctionObjArgs(self->of_frame, c, user, NULL) : NULL;
        Py_XDECREF(user);
        if (found == NULL || !PyTuple_Check(found) || PyTuple_GET_SIZE(found) < 1) {
            Py_XDECREF(found);
            goto broken_or_slow;
        }
        Py_SETREF(site_obj, Py_NewRef(PyTuple_GET_ITEM(found, 0)));
        Py_DECREF(found);
    }
    seq_obj = seq_now(PyTuple_GET_ITEM(known, 0), PyTuple_GET_ITEM(known, 10));
    if (seq_obj == NULL) goto broken;

    int64_t t0 = now_ns();
    /* the live status: (phase, op, seq, t0, gname, gsize, nbytes, pg, signature) */
    static const signed char tail[] = {1, 2, 3, 0, 4, -2};
    progress_enter(s, &saved, self->phase, self->op, seq_obj, known, tail, t0);
    int ringed = ring_now(self, s) == 0, seq_bad = 0;
    Value seq = as_value(seq_obj, self->layout.codes[8], &seq_bad);
    if (ringed && !seq_bad) { /* the call it died in, if it dies in it (trace/ring.py) */
        int ids_bad = self->ids_bad;
        long long sid = self->image_sid, site = self->image_site;
        if (known != self->image_of) {
            ids_bad = 0;
            sid = as_i64(PyTuple_GET_ITEM(known, 9), &ids_bad);
        }
        if (known != self->image_of || site_obj != PyTuple_GET_ITEM(known, 8)) site = as_i64(site_obj, &ids_bad);
        if (!ids_bad) enter_call(&s->pack.ring, seq.i, sid, site);
    }
    PyErr_Clear(); /* best effort: the record after the call says what it can */
    result = PyObject_Call(self->orig, args, kwargs);
    if (result == NULL) {
        coll_raised(self, c, s, &saved, known, seq_obj, site_obj, async_);
        goto done;
    }
    int64_t t1 = now_ns();
    progress_leave(s, &saved);
    s->events++;
    if (ringed) record(self, s, known, seq, seq_bad, site_obj, async_, t0, t1);
    /* the call returned: a record we could not make is lost, never the result; but what a
     * signal handler raised while we recorded is the program's */
    if (clear_own_error() < 0) Py_CLEAR(result);
    goto done;

broken_or_slow:
    if (!PyErr_Occurred()) goto slow;
broken:
    if (PyErr_Occurred()) {
        result = coll_broke(self, c, args, kwargs);
        goto done;
    }
slow:
    result = PyObject_Call(self->slow, args, kwargs);
    goto done;
plain:
    if (PyErr_Occurred()) goto broken;
    result = passthrough(self, args, kwargs);
done:
    Py_XDECREF(seq_obj);
    Py_XDECREF(site_obj);
    Py_XDECREF(known);
    frame_done(&frame);
    Py_DECREF(c);
    return result;
}

PyTypeObject CollectiveType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.probes._fast.Collective",
    .tp_basicsize = sizeof(Collective),
    .tp_vectorcall_offset = offsetof(Collective, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A collective's recording for call sites seen before (see probes/collectives.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Collective_init,
    .tp_dealloc = (destructor)Collective_dealloc,
    .tp_call = PyVectorcall_Call,
};

