/* The probes' hot paths in C (probes/fastpath.py says when they run):
 *
 * - Collective: what probes/collectives.py does in Python for a call it has seen before (same
 *   instruction, group, tensor dtype and size), without a Python frame, a tuple of fields or
 *   a dozen integer objects per event. Called as fast(args, kwargs) by the Python wrapper that
 *   replaced torch.distributed's function (it stays Python so that torch.compile still inlines
 *   it and sees torch.compiler.is_compiling()); every other case goes to that path,
 *   ``slow(*args, **kwargs)``: a new call site, a non-tensor first argument.
 * - RingSeqs: a ring's event numbers and its mapping (trace/ring.py's Seqs, in C), through
 *   which every record made in C is written without a Python object.
 * - Packer: the trace writer's pack (trace/writer.py) of one event of one kind into the ring,
 *   or of many at once (_fast_packer.c).
 * - site(): the call-site lookup of probes/callsite.py for a call made from an instruction
 *   whose site is known; None sends the caller to the Python walk, which learns it.
 * - DdpProbe: the DDP forward and backward probes' steady state (_fast_ddp.c).
 * - State: the collector's per-event fields, its base class, which every probe here reads and
 *   writes directly (_fast_state.c).
 * - set_native(capsule): the C++ timer's readers and step writer (probes/native.py).
 * - run_queue_us(), none_grads(params): the backward probe's per-step reads (_fast_step.c).
 * - exit_code(path): the status a rank exits with through exit() (the script's end, sys.exit,
 *   SystemExit), which Python tells no handler of its own (probes/lastwords.py).
 *
 * A record is packed by the layout of the ``struct`` format the Python writer packs the same
 * kind with (trace/ring.py's slot_struct), parsed once here: the format stays the one
 * declaration. A value is coerced to its type as the writer's pack_odd coerces it (``as_value``);
 * a record that still does not fit leaves its slot void and is counted in the ring's ``lost``.
 * The slot's seq, its last value, is stored last, as the Python path does, so that a slot
 * caught mid-write by a death keeps its old seq.
 */
#include "_fast.h"
#include <structmember.h>

/* Names looked up on each call, interned once. */
PyObject *s_active, *s_ring, *s_seqs, *s_dtype, *s_nbytes, *s_group, *s_async_op, *s_collectives, *s_raised,
    *s_lost, *s_seq_method, *s_compiling_flag, *one;

int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic_ns's clock */
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* A struct format of codes x H b i I q Q d with counts, little-endian ("<"): the offset of
 * each value. Returns -1 on a format this file does not know. */
int parse_format(Layout *self, const char *fmt) {
    int at = 0, n = 0;
    if (*fmt == '<') fmt++;
    while (*fmt) {
        int count = 0;
        while (*fmt >= '0' && *fmt <= '9') count = count * 10 + (*fmt++ - '0');
        if (!count) count = 1;
        char c = *fmt++;
        int width;
        switch (c) {
            case 'x': at += count; continue;
            case 'b': width = 1; break;
            case 'H': width = 2; break;
            case 'i': case 'I': width = 4; break;
            case 'q': case 'Q': case 'd': width = 8; break;
            default: return -1;
        }
        for (int k = 0; k < count; k++) {
            if (n >= MAX_FIELDS) return -1;
            self->codes[n] = c;
            self->offsets[n++] = at;
            at += width;
        }
    }
    self->ncodes = n;
    self->size = at;
    return 0;
}

/* Store one value by its code; 0 when it does not fit. */
int store(char *base, char code, int offset, Value value) {
    char *p = base + offset;
    int64_t v = value.i;
    switch (code) {
        case 'b': { if (v < -128 || v > 127) return 0; int8_t x = (int8_t)v; memcpy(p, &x, 1); return 1; }
        case 'H': { if (v < 0 || v > 0xFFFF) return 0; uint16_t x = (uint16_t)v; memcpy(p, &x, 2); return 1; }
        case 'i': { if (v < INT32_MIN || v > INT32_MAX) return 0; int32_t x = (int32_t)v; memcpy(p, &x, 4); return 1; }
        case 'I': { if (v < 0 || v > (int64_t)UINT32_MAX) return 0; uint32_t x = (uint32_t)v; memcpy(p, &x, 4); return 1; }
        case 'q': memcpy(p, &v, 8); return 1;
        case 'd': memcpy(p, &value.d, 8); return 1;
        default: return 0;
    }
}

int64_t as_i64(PyObject *v, int *bad) {
    int overflow = 0;
    long long x = PyLong_Check(v) ? PyLong_AsLongLongAndOverflow(v, &overflow) : 0;
    if (!PyLong_Check(v) || overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *bad = 1;
        return 0;
    }
    return x;
}

/* A Python value as a field of type ``code``, as the writer packs it: struct's own conversion
 * where it takes the value, else writer._coerce's (int(v), or -1 where int() refuses it; a
 * float field takes 0.0 for what is not a number). ``*bad``: it fits no field of this type
 * (an int too wide for 64 bits), so the record is lost. */
Value as_value(PyObject *v, char code, int *bad) {
    Value out;
    if (code == 'd') {
        out.d = PyFloat_AsDouble(v);
        if (out.d == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            if (PyLong_Check(v) || PyFloat_Check(v)) *bad = 1; /* float(v) raises: too wide */
            out.d = 0.0;
        }
        return out;
    }
    if (PyLong_Check(v)) {
        out.i = as_i64(v, bad);
        return out;
    }
    PyObject *n = PyNumber_Long(v);
    if (n == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_ValueError) &&
            !PyErr_ExceptionMatches(PyExc_OverflowError))
            *bad = 1; /* int(v) raised something else: _coerce lets it through, pack_odd loses it */
        PyErr_Clear();
        out.i = -1;
        return out;
    }
    out.i = as_i64(n, bad);
    Py_DECREF(n);
    return out;
}

void ring_clear(RingRef *r) {
    Py_CLEAR(r->ring);
    Py_CLEAR(r->seqs);
}

/* Point ``r`` at ``ring`` (looked up again only when the ring changes); -1 when it is not one
 * whose seqs are held here (the Python path's ring, where this module was not loaded). */
int ring_set(RingRef *r, PyObject *ring) {
    if (ring == r->ring) return 0;
    PyObject *seqs = PyObject_GetAttr(ring, s_seqs);
    if (seqs == NULL || !PyObject_TypeCheck(seqs, &RingSeqsType)) {
        Py_XDECREF(seqs);
        PyErr_Clear();
        return -1;
    }
    ring_clear(r);
    Py_INCREF(ring);
    r->ring = ring;
    r->seqs = (RingSeqs *)seqs;
    return 0;
}

/* ring.lost += 1: a record lost to a value out of its type's range (rare: Python is fine). */
static void count_lost(RingRef *r) {
    PyObject *lost = PyObject_GetAttr(r->ring, s_lost);
    PyObject *more = lost ? PyNumber_Add(lost, one) : NULL;
    if (more == NULL || PyObject_SetAttr(r->ring, s_lost, more) < 0) PyErr_Clear();
    Py_XDECREF(more); Py_XDECREF(lost);
}

/* The ring's next slot, claimed (*seq its number): where its record goes, or NULL when the
 * mapping is gone or too small for it. */
static char *slot_claim(RingRef *r, const Layout *layout, uint64_t *seq) {
    RingSeqs *q = r->seqs;
    *seq = ++q->n;
    Py_ssize_t at = RING_HEADER + (Py_ssize_t)(*seq & (uint64_t)q->mask) * RING_SLOT;
    return q->held && at + layout->size <= q->view.len ? (char *)q->view.buf + at : NULL;
}

/* The claimed slot's record is written (or void, when ``bad``): its seq last, then the head. */
static void slot_done(RingRef *r, const Layout *layout, char *base, uint64_t seq, int bad) {
    if (base != NULL) {
        if (bad) {
            uint16_t void_kind = RING_VOID;
            memcpy(base, &void_kind, 2);
        }
        __atomic_signal_fence(__ATOMIC_SEQ_CST); /* the record first, then its seq */
        memcpy(base + layout->offsets[layout->ncodes - 1], &seq, 8);
    }
    r->seqs->head = seq;
    if (bad || base == NULL) count_lost(r);
}

void put_record(RingRef *r, const Layout *layout, const Value *values, int bad) {
    uint64_t seq;
    char *base = slot_claim(r, layout, &seq);
    for (int i = 0; base != NULL && i < layout->ncodes - 1 && !bad; i++)
        if (!store(base, layout->codes[i], layout->offsets[i], values[i])) bad = 1;
    slot_done(r, layout, base, seq, bad);
}

void put_image(RingRef *r, const Layout *layout, const char *image, const int *vary, const Value *values,
               int bad) {
    uint64_t seq;
    char *base = slot_claim(r, layout, &seq);
    if (base != NULL) {
        memcpy(base, image, (size_t)layout->offsets[layout->ncodes - 1]);
        for (int i = 0; vary[i] >= 0 && !bad; i++)
            if (!store(base, layout->codes[vary[i]], layout->offsets[vary[i]], values[i])) bad = 1;
    }
    slot_done(r, layout, base, seq, bad);
}

/* The collective the training thread enters now, into the ring's header: its record is written
 * as it returns, so this is what a rank killed inside it leaves of it. Nothing on a value that
 * does not fit (the record says what it can then). */
void enter_call(RingRef *r, int64_t seq, int64_t sid, int64_t site) {
    RingSeqs *q = r->seqs;
    if (sid < INT32_MIN || sid > INT32_MAX || site < INT32_MIN || site > INT32_MAX) return;
    if (q->held && q->view.len >= RING_CALL_AT + 16) {
        int32_t ids[2] = {(int32_t)sid, (int32_t)site};
        memcpy((char *)q->view.buf + RING_CALL_AT, &seq, 8);
        memcpy((char *)q->view.buf + RING_CALL_AT + 8, ids, 8);
    }
}

/* ------------------------------------------------------------------ RingSeqs */

static int RingSeqs_init(RingSeqs *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"mm", "mask", NULL};
    PyObject *mm;
    long long mask;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OL", names, &mm, &mask)) return -1;
    if (self->held) {
        PyErr_SetString(PyExc_RuntimeError, "RingSeqs: already holds a mapping");
        return -1;
    }
    if (mask < 0 || PyObject_GetBuffer(mm, &self->view, PyBUF_WRITABLE) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "RingSeqs: a negative mask");
        return -1;
    }
    self->held = 1;
    self->mask = mask;
    return 0;
}

static PyObject *RingSeqs_release(RingSeqs *self, PyObject *unused) {
    if (self->held) {
        self->held = 0;
        PyBuffer_Release(&self->view);
    }
    Py_RETURN_NONE;
}

static PyObject *RingSeqs_next(RingSeqs *self, PyObject *unused) { return PyLong_FromUnsignedLongLong(++self->n); }

static void RingSeqs_dealloc(RingSeqs *self) {
    if (self->held) PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef RingSeqs_methods[] = {
    {"next", (PyCFunction)RingSeqs_next, METH_NOARGS, "Claim the next seq (from 1)."},
    {"release", (PyCFunction)RingSeqs_release, METH_NOARGS, "Let go of the mapping, before it is closed."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef RingSeqs_members[] = {
    {"head", T_ULONGLONG, offsetof(RingSeqs, head), 0, "The last seq written (by any thread)."},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject RingSeqsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.probes._fast.RingSeqs",
    .tp_basicsize = sizeof(RingSeqs),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A ring's event numbers and its mapping, written by the C probes with no Python object.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RingSeqs_init,
    .tp_dealloc = (destructor)RingSeqs_dealloc,
    .tp_methods = RingSeqs_methods,
    .tp_members = RingSeqs_members,
};

/* ------------------------------------------------------------------ site() */

/* site(frame_depth, calls, is_user): the interned site of the first user frame at or above the
 * caller's ``frame_depth``-th frame, when callsite.py has already learnt it; else None. */
static PyObject *site(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_Check(argv[1]) || !PyDict_Check(argv[2])) {
        PyErr_SetString(PyExc_TypeError, "site(depth, calls: dict, is_user: dict)");
        return NULL;
    }
    long depth = PyLong_AsLong(argv[0]);
    if (depth == -1 && PyErr_Occurred()) return NULL;
    Frame frame;
    if (frame_caller(&frame, depth < 0 ? 0 : depth > INT_MAX ? INT_MAX : (int)depth) < 0) Py_RETURN_NONE;
    PyObject *found = site_from(&frame, argv[1], argv[2]);
    frame_done(&frame);
    return found;
}

#ifdef __GLIBC__
#include <fcntl.h>
#include <unistd.h>

static char exit_path[4096];
static char exit_called[8192]; /* what the last sys.exit(...) call said (JSON), or empty */
static pid_t exit_pid;
static int exit_written;

/* glibc's on_exit handlers run after Python's finalization, so this one is plain C: a few
 * system calls, once. Handlers run last registered first: registered again at Python's exit,
 * it runs before libtorch's static destructors, which may block on a peer until the launcher
 * kills the rank. A child forked from the rank (a DataLoader worker) inherits the handler and
 * writes nothing: only the process that asked records its status. */
static void write_exit_status(int status, void *unused) {
    (void)unused;
    if (getpid() != exit_pid || exit_written) return;
    exit_written = 1;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    char text[128];
    int n = snprintf(text, sizeof text, "{\"how\": \"exit\", \"code\": %d, \"wall_ns\": %lld",
                     status & 0xff, (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    int fd = open(exit_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return;
    ssize_t ok = write(fd, text, (size_t)n);
    if (exit_called[0]) {
        ok = write(fd, ", \"called\": ", 12);
        ok = write(fd, exit_called, strlen(exit_called));
    }
    ok = write(fd, "}", 1);
    (void)ok;
    close(fd);
}
#endif

/* exit_code(path) -> bool: write {"how": "exit", "code": N, "wall_ns": T} to path when this
 * process ends through exit(); False where the C library offers no on_exit (not glibc). Call it
 * at the process's start and again at Python's exit (atexit), no more. */
static PyObject *exit_code(PyObject *self, PyObject *arg) {
    (void)self;
#ifdef __GLIBC__
    static int registered;
    Py_ssize_t size;
    const char *path = PyUnicode_AsUTF8AndSize(arg, &size);
    if (path == NULL) return NULL;
    if ((size_t)size >= sizeof exit_path) {
        PyErr_SetString(PyExc_ValueError, "path too long");
        return NULL;
    }
    memcpy(exit_path, path, (size_t)size + 1);
    if (exit_pid != getpid()) registered = 0; /* a forked child registers its own */
    exit_pid = getpid();
    if (registered < 2) { /* at start (an exit() from native code), and again at Python's exit */
        if (on_exit(write_exit_status, NULL) != 0) {
            PyErr_SetString(PyExc_OSError, "on_exit() refused the handler");
            return NULL;
        }
        registered++;
    }
    Py_RETURN_TRUE;
#else
    (void)arg;
    Py_RETURN_FALSE;
#endif
}

/* exit_note(json): what a sys.exit() call said (its code, its caller's stack), written with the
 * status; the latest call's, for it may have been caught. One too long for the buffer is dropped. */
static PyObject *exit_note(PyObject *self, PyObject *arg) {
    (void)self;
#ifdef __GLIBC__
    Py_ssize_t size;
    const char *note = PyUnicode_AsUTF8AndSize(arg, &size);
    if (note == NULL) return NULL;
    if ((size_t)size >= sizeof exit_called) size = 0;
    memcpy(exit_called, note, (size_t)size);
    exit_called[size] = 0;
#else
    (void)arg;
#endif
    Py_RETURN_NONE;
}

/* The C++ timer's readers and step writer (_hook.cpp's capsules), once set_native is given them:
 * a group's sequence number, a tensor's dtype and bytes, whether a parameter has no gradient,
 * and the step its notes carry. NULL until then: the probes ask Python. */
static int64_t (*seq_reader)(PyObject *group) = NULL;
static int (*tensor_reader)(PyObject *tensor, PyObject **dtype, int64_t *nbytes) = NULL;
int (*grad_reader)(PyObject *param) = NULL;
void (*step_writer)(int64_t step) = NULL;

static PyObject *set_native(PyObject *mod, PyObject *capsule) {
    static const struct {
        const char *name;
        void **slot;
    } natives[] = {
        {"ddpdoctor.seq_of", (void **)&seq_reader},
        {"ddpdoctor.tensor_meta", (void **)&tensor_reader},
        {"ddpdoctor.grad_missing", (void **)&grad_reader},
        {"ddpdoctor.step_now", (void **)&step_writer},
    };
    const char *name = PyCapsule_GetName(capsule);
    if (name == NULL && PyErr_Occurred()) return NULL;
    for (size_t i = 0; name != NULL && i < sizeof natives / sizeof natives[0]; i++) {
        if (strcmp(name, natives[i].name) != 0) continue;
        void *f = PyCapsule_GetPointer(capsule, name);
        if (f == NULL) return NULL;
        *natives[i].slot = f;
        Py_RETURN_NONE;
    }
    PyErr_Format(PyExc_ValueError, "set_native: no use for a capsule named %s", name ? name : "(none)");
    return NULL;
}

/* ``group``'s collective sequence number now, a new int: read in C++ where the timer's reader
 * is set, else ``seq_of()`` (``group._get_sequence_number_for_group()`` where it is NULL). */
PyObject *seq_now(PyObject *group, PyObject *seq_of) {
    if (seq_reader != NULL && group != Py_None) {
        int64_t seq = seq_reader(group);
        if (seq != -2) return PyLong_FromLongLong(seq);
    }
    return seq_of ? PyObject_CallNoArgs(seq_of) : PyObject_CallMethodNoArgs(group, s_seq_method);
}

int tensor_now(PyObject *tensor, PyObject **dtype, int64_t *nbytes) {
    if (tensor_reader != NULL && tensor_reader(tensor, dtype, nbytes) == 0) {
        Py_INCREF(*dtype);
        return 0;
    }
    *dtype = PyObject_GetAttr(tensor, s_dtype);
    PyObject *n = *dtype ? PyObject_GetAttr(tensor, s_nbytes) : NULL;
    int bad = 0;
    *nbytes = n ? as_i64(n, &bad) : 0;
    Py_XDECREF(n);
    if (n == NULL || bad) {
        Py_CLEAR(*dtype);
        return -1;
    }
    return 0;
}

static PyMethodDef functions[] = {
    {"set_native", set_native, METH_O, "Use one of the C++ timer's readers or its step writer (a capsule)."},
    {"site", (PyCFunction)(void (*)(void))site, METH_FASTCALL, "The call site callsite.py has learnt, or None."},
    {"exit_code", exit_code, METH_O, "Record the status this process exits with to a file (glibc's on_exit)."},
    {"exit_note", exit_note, METH_O, "What the last sys.exit() call said, written with the status."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fast", "The probes' hot paths in C (probes/fastpath.py).", -1,
    functions, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fast(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_active, "ACTIVE"); INTERN(s_ring, "ring"); INTERN(s_seqs, "seqs");
    INTERN(s_dtype, "dtype");
    INTERN(s_nbytes, "nbytes"); INTERN(s_group, "group"); INTERN(s_async_op, "async_op");
    INTERN(s_collectives, "collectives"); INTERN(s_raised, "raised"); INTERN(s_lost, "lost");
    INTERN(s_seq_method, "_get_sequence_number_for_group"); INTERN(s_compiling_flag, "_is_compiling_flag");
#undef INTERN
    if ((one = PyLong_FromLong(1)) == NULL) return NULL;
    if (PyType_Ready(&CollectiveType) < 0 || PyType_Ready(&PackerType) < 0 || PyType_Ready(&RingSeqsType) < 0 || PyType_Ready(&StateType) < 0 ||
        step_init() < 0 || ddp_init() < 0 || opt_init() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddFunctions(m, step_functions) < 0 ||
        PyModule_AddObjectRef(m, "Collective", (PyObject *)&CollectiveType) < 0 ||
        PyModule_AddObjectRef(m, "Packer", (PyObject *)&PackerType) < 0 ||
        PyModule_AddObjectRef(m, "RingSeqs", (PyObject *)&RingSeqsType) < 0 ||
        PyModule_AddObjectRef(m, "State", (PyObject *)&StateType) < 0 ||
        PyModule_AddObjectRef(m, "DdpProbe", (PyObject *)&DdpProbeType) < 0 ||
        PyModule_AddObjectRef(m, "OptimizerProbe", (PyObject *)&OptProbeType) < 0 ||
        PyModule_AddIntConstant(m, "RING_HEADER", RING_HEADER) < 0 ||
        PyModule_AddIntConstant(m, "RING_SLOT", RING_SLOT) < 0 ||
        PyModule_AddIntConstant(m, "RING_VOID", RING_VOID) < 0 ||
        PyModule_AddIntConstant(m, "RING_CALL_AT", RING_CALL_AT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
