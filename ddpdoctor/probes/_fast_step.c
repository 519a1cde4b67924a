/* The backward probe's work after the call, in C (_fast_ddp.c's DdpProbe calls it), and its
 * two per-step reads, which the Python path calls too. In a step's context (after autograd's
 * C++ ran, caches cold) their Python took about 12 and 7 µs of a 0.7 ms step here.
 *
 * - run_queue_us(): probes/cpuwait.py's read of this thread's run-queue delay from
 *   /proc/thread-self/schedstat, one pread of a descriptor kept per thread.
 * - none_grads(params): the indices of the parameters whose .grad is None (ddp.check_unused).
 * - after_backward(): the C++ timer's bucket layouts (while DDP lays them out), the run-queue
 *   read, the backward's record, the unused check, as probes/ddp.py's backward probe does
 *   them; pack_event(): a record packed as trace/writer.py's pack does it.
 */
#include "_fast.h"

static PyObject *s_grad, *s_fast, *s_pack, *s_native_name, *s_find_unused, *s_params, *s_unused_name;

#ifdef __linux__
#include <fcntl.h>
#include <unistd.h>

static __thread int schedstat_fd = -1; /* this thread's descriptor, opened at its first read */
static int opened, broken;             /* written under the GIL */

/* As cpuwait.run_queue_us: -1 where the kernel does not say, and from then on; at most 8
 * threads get a descriptor (a new thread each step would leak them). */
PyObject *run_queue_now(void) {
    if (broken) return PyLong_FromLong(-1);
    if (schedstat_fd < 0) {
        if (opened >= 8) {
            broken = 1;
            return PyLong_FromLong(-1);
        }
        schedstat_fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
        if (schedstat_fd < 0) {
            broken = 1;
            return PyLong_FromLong(-1);
        }
        opened++;
    }
    char buf[96];
    ssize_t n = pread(schedstat_fd, buf, sizeof buf - 1, 0);
    if (n <= 0) {
        broken = 1;
        return PyLong_FromLong(-1);
    }
    buf[n] = 0;
    char *end;
    strtoull(buf, &end, 10); /* ns on a CPU */
    if (end == buf || *end != ' ') {
        broken = 1;
        return PyLong_FromLong(-1);
    }
    char *start = end + 1;
    unsigned long long waited = strtoull(start, &end, 10); /* ns waiting on a run queue */
    if (end == start) {
        broken = 1;
        return PyLong_FromLong(-1);
    }
    return PyLong_FromUnsignedLongLong(waited / 1000);
}
#else
PyObject *run_queue_now(void) { return PyLong_FromLong(-1); }
#endif

static PyObject *run_queue_us(PyObject *module, PyObject *unused) { return run_queue_now(); }


/* none_grads(params: list | tuple): [i for i, p in enumerate(params) if p.grad is None] */
PyObject *none_grads_of(PyObject *params) {
    PyObject *seq = PySequence_Fast(params, "none_grads(params): a list or tuple");
    if (seq == NULL) return NULL;
    PyObject *out = PyList_New(0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        int missing = grad_reader ? grad_reader(items[i]) : -1;
        if (missing < 0) {
            PyObject *grad = PyObject_GetAttr(items[i], s_grad);
            if (grad == NULL) {
                Py_CLEAR(out);
                break;
            }
            missing = grad == Py_None;
            Py_DECREF(grad);
        }
        if (missing) {
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || PyList_Append(out, index) < 0) Py_CLEAR(out);
            Py_XDECREF(index);
        }
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *none_grads(PyObject *module, PyObject *params) { return none_grads_of(params); }

PyObject *ring_of(State *s, PyObject *writer) {
    PackMemo *m = &s->pack;
    if (writer == m->writer && m->ring.seqs && m->ring.seqs->held) return Py_NewRef(m->ring.ring);
    PyObject *ring = PyObject_GetAttr(writer, s_ring);
    if (ring == NULL || ring == Py_None) {
        Py_XDECREF(ring);
        return NULL;
    }
    if (ring_set(&m->ring, ring) == 0) { /* its seqs held in C: kept */
        Py_INCREF(writer);
        Py_XSETREF(m->writer, writer);
    }
    return ring;
}

/* ``kind``'s packer (borrowed: None where the writer packs in Python), or NULL on error. */
static PyObject *packer_of(State *s, PyObject *kind) {
    PackMemo *m = &s->pack;
    int i = 0;
    for (; i < PACKERS && m->kinds[i] != NULL; i++)
        if (m->kinds[i] == kind) return m->packers[i];
    PyObject *fast = PyObject_GetAttr(kind, s_fast);
    if (fast == NULL) return NULL;
    if (i == PACKERS) { /* more kinds than it keeps: the oldest goes */
        Py_CLEAR(m->kinds[0]);
        Py_CLEAR(m->packers[0]);
        memmove(m->kinds, m->kinds + 1, (PACKERS - 1) * sizeof(PyObject *));
        memmove(m->packers, m->packers + 1, (PACKERS - 1) * sizeof(PyObject *));
        i = PACKERS - 1;
        m->kinds[i] = m->packers[i] = NULL;
    }
    m->kinds[i] = Py_NewRef(kind);
    m->packers[i] = fast;
    return fast;
}

/* c.pack(kind, t0, t1, c.step, fields) as trace/writer.py's pack does it, with the kind's C
 * packer called from here, and the event counted. A record we cannot make is lost; what a
 * signal handler raised in the writer's Python path is left set (clear_own_error). */
void pack_event(State *s, PyObject *kind, int64_t t0, int64_t t1, PyObject *fields) {
    s->events++;
    PyObject *writer = s->writer;
    if (kind == NULL || writer == NULL) return;
    Py_INCREF(writer);
    PyObject *ring = ring_of(s, writer);
    PyObject *fast = ring ? packer_of(s, kind) : NULL;
    if (fast != NULL) {
        Py_INCREF(fast); /* held across the write: the writer's Python path may run */
        if (!packer_put(fast, ring, s->step, t0, t1, fields)) {
            /* no C packer, or no slot taken: the writer's own path */
            PyObject *step = PyLong_FromLongLong(s->step), *t0_obj = step ? PyLong_FromLongLong(t0) : NULL;
            PyObject *t1_obj = t0_obj ? PyLong_FromLongLong(t1) : NULL;
            PyObject *again = t1_obj ? PyObject_CallMethodObjArgs(writer, s_pack, kind, t0_obj, t1_obj, step, fields, NULL)
                                     : NULL;
            Py_XDECREF(again); Py_XDECREF(t1_obj); Py_XDECREF(t0_obj); Py_XDECREF(step);
        }
        Py_DECREF(fast);
    }
    Py_XDECREF(ring);
    Py_DECREF(writer);
    clear_own_error();
}

/* The error being raised, normalised, as (type, value, traceback): restored unchanged. */
Raised fetch(void) {
    Raised e;
    PyErr_Fetch(&e.type, &e.value, &e.tb);
    PyErr_NormalizeException(&e.type, &e.value, &e.tb);
    if (e.tb && e.value) PyException_SetTraceback(e.value, e.tb);
    return e;
}

/* After a call into Python failed, or with what it left set: a probe's own error is cleared
 * (0); what one of the program's signal handlers raised there (guard.py's test: a handler's
 * frame in its traceback), or a KeyboardInterrupt, stays set for the caller to return (-1).
 * Python runs signal handlers between any two bytecodes, inside our helpers too. */
int clear_own_error(void) {
    static PyObject *by_handler;
    if (!PyErr_Occurred()) return 0;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    Raised e = fetch();
    if (by_handler == NULL) {
        PyObject *guard = PyImport_ImportModule("ddpdoctor.probes.guard");
        by_handler = guard ? PyObject_GetAttrString(guard, "raised_by_signal_handler") : NULL;
        Py_XDECREF(guard);
    }
    PyObject *r = by_handler && e.value ? PyObject_CallOneArg(by_handler, e.value) : NULL;
    int program = r == Py_True;
    Py_XDECREF(r);
    PyErr_Clear();
    if (program) {
        PyErr_Restore(e.type, e.value, e.tb);
        return -1;
    }
    Py_XDECREF(e.type); Py_XDECREF(e.value); Py_XDECREF(e.tb);
    return 0;
}

/* helpers: (commhook.drain, ddp.check_unused, ddp.note_unused); errors are logged through
 * c.fail, as in Python, but for a signal handler's, left set for the caller. */
static int call_helper(PyObject *helpers, PyObject *c, PyObject *what, int i, PyObject *a, PyObject *b) {
    PyObject *r = PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(helpers, i), c, a, b, NULL);
    if (r != NULL) {
        Py_DECREF(r);
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    Raised e = fetch();
    PyObject *f = PyObject_CallMethod(c, "fail", "OO", what, e.value ? e.value : Py_None);
    Py_XDECREF(e.type); Py_XDECREF(e.value); Py_XDECREF(e.tb);
    if (f == NULL) return -1; /* c.fail raises only what a signal handler raised: the program's */
    Py_DECREF(f);
    return 0;
}

/* After a recorded backward returned: the C++ timer's drain while DDP may still lay out its
 * buckets (commhook.drain_settling), the run-queue read, the record, then the unused-parameter
 * check (probes/ddp.py's order). */
void after_backward(State *s, Progress *saved, int64_t t0, PyObject *helpers) {
    PyObject *c = (PyObject *)s;
    int drain = s->native_settling ? PyObject_IsTrue(s->native_settling) : 0;
    PyErr_Clear();
    if (drain > 0 && call_helper(helpers, c, s_native_name, 0, NULL, NULL) < 0) {
        Raised e = fetch(); /* the program's: the rank is no longer in its backward */
        progress_leave(s, saved);
        PyErr_Restore(e.type, e.value, e.tb);
        return;
    }
    progress_leave(s, saved);
    PyObject *runq = run_queue_now();
    PyObject *fields = runq ? PyTuple_Pack(1, runq) : NULL;
    Py_XDECREF(runq);
    if (fields != NULL) pack_event(s, s->backward_kind, t0, now_ns(), fields);
    Py_XDECREF(fields);
    if (clear_own_error() < 0) return;
    /* which parameters got no gradient: DDP's used map with find_unused_parameters (Python),
     * else the parameters whose .grad is still None, noted in Python when there are any */
    PyObject *state = s->step_model;
    if (state == NULL || state == Py_None) return;
    Py_INCREF(state);
    PyObject *sd = PyObject_GenericGetDict(state, NULL);
    PyObject *find = sd ? PyDict_GetItemWithError(sd, s_find_unused) : NULL;
    PyObject *params = find ? PyDict_GetItemWithError(sd, s_params) : NULL;
    int global = params ? PyObject_IsTrue(find) : -1;
    PyObject *missing = global == 0 ? none_grads_of(params) : NULL;
    if (global == 1) {
        call_helper(helpers, c, s_unused_name, 1, NULL, NULL);
    } else if (missing != NULL && PyList_GET_SIZE(missing) > 0) {
        call_helper(helpers, c, s_unused_name, 2, state, missing);
    } else if (missing == NULL) { /* as an error in Python's check: logged, the probe goes on */
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "a model state without its parameters");
        if (PyErr_ExceptionMatches(PyExc_Exception)) {
            Raised e = fetch();
            PyObject *f = PyObject_CallMethod(c, "fail", "OO", s_unused_name, e.value ? e.value : Py_None);
            Py_XDECREF(f); /* NULL: a signal handler's exception, left set for the caller */
            Py_XDECREF(e.type); Py_XDECREF(e.value); Py_XDECREF(e.tb);
        }
    }
    Py_XDECREF(missing); Py_XDECREF(sd); Py_DECREF(state);
}

PyMethodDef step_functions[] = {
    {"run_queue_us", run_queue_us, METH_NOARGS, "This thread's run-queue delay so far, µs (-1 unknown)."},
    {"none_grads", none_grads, METH_O, "The indices of the parameters whose .grad is None."},
    {NULL, NULL, 0, NULL},
};

int step_init(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1
    INTERN(s_grad, "grad"); INTERN(s_fast, "fast"); INTERN(s_pack, "pack"); INTERN(s_native_name, "comm_hook_native");
    INTERN(s_find_unused, "find_unused"); INTERN(s_params, "params"); INTERN(s_unused_name, "unused");
#undef INTERN
    return 0;
}
