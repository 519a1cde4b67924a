/* The probes' hot paths in C (probes/fastpath.py says when they run):
 *
 * - Collective: what probes/collectives.py does in Python for a call it has seen before (same
 *   instruction, group, tensor dtype and size), without a Python frame, a tuple of fields or
 *   a dozen integer objects per event. Called as fast(args, kwargs) by the Python wrapper that
 *   replaced torch.distributed's function (it stays Python so that torch.compile still inlines
 *   it and sees torch.compiler.is_compiling()); every other case goes to that path,
 *   ``slow(*args, **kwargs)``: a new call site, a non-tensor first argument.
 * - RingSeqs: a ring's event numbers and its mapping (trace/ring.py's Seqs, in C), through
 *   which every record made in C is written without a Python object; the slots, and how a
 *   record is laid out and its values coerced (_fast_ring.c).
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

 */
#include "_fast.h"

/* Names looked up on each call, interned once. */
PyObject *s_active, *s_ring, *s_seqs, *s_dtype, *s_nbytes, *s_group, *s_async_op, *s_collectives, *s_raised,
    *s_lost, *s_seq_method, *s_compiling_flag, *one;

int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic_ns's clock */
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

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
        PyModule_AddIntConstant(m, "RING_CALL_AT", RING_CALL_AT) < 0 ||
        PyModule_AddIntConstant(m, "RING_BODY_AT", RING_BODY_AT) < 0 ||
        PyModule_AddIntConstant(m, "RING_SEQ_AT", RING_SEQ_AT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
