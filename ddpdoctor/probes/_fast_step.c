/* Two per-step reads of probes/ddp.py's backward probe in C: in a step's context (after
 * autograd's C++ ran, caches cold) their Python took about 12 and 7 µs of a 0.7 ms step here.
 *
 * - run_queue_us(): probes/cpuwait.py's read of this thread's run-queue delay from
 *   /proc/thread-self/schedstat, one pread of a descriptor kept per thread.
 * - none_grads(params): the indices of the parameters whose .grad is None (ddp.check_unused).
 */
#include "_fast.h"

#ifdef __linux__
#include <fcntl.h>
#include <unistd.h>

static __thread int schedstat_fd = -1; /* this thread's descriptor, opened at its first read */
static int opened, broken;             /* written under the GIL */

/* As cpuwait.run_queue_us: -1 where the kernel does not say, and from then on; at most 8
 * threads get a descriptor (a new thread each step would leak them). */
static PyObject *run_queue_us(PyObject *module, PyObject *unused) {
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
static PyObject *run_queue_us(PyObject *module, PyObject *unused) { return PyLong_FromLong(-1); }
#endif

static PyObject *s_grad;

/* none_grads(params: list | tuple): [i for i, p in enumerate(params) if p.grad is None] */
static PyObject *none_grads(PyObject *module, PyObject *params) {
    PyObject *seq = PySequence_Fast(params, "none_grads(params): a list or tuple");
    if (seq == NULL) return NULL;
    PyObject *out = PyList_New(0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *grad = PyObject_GetAttr(items[i], s_grad);
        if (grad == NULL) {
            Py_CLEAR(out);
            break;
        }
        if (grad == Py_None) {
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || PyList_Append(out, index) < 0) Py_CLEAR(out);
            Py_XDECREF(index);
        }
        Py_DECREF(grad);
    }
    Py_DECREF(seq);
    return out;
}

PyMethodDef step_functions[] = {
    {"run_queue_us", run_queue_us, METH_NOARGS, "This thread's run-queue delay so far, µs (-1 unknown)."},
    {"none_grads", none_grads, METH_O, "The indices of the parameters whose .grad is None."},
    {NULL, NULL, 0, NULL},
};

int step_init(void) {
    s_grad = PyUnicode_InternFromString("grad");
    return s_grad == NULL ? -1 : 0;
}
