/* The trace writer's pack (trace/writer.py) in C: one event of one kind into the ring, or the
 * C++ bucket timer's notes many at once (see _fast_ring.c for the layout and the ring). */
#include "_fast.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Layout layout;
    long long kid;
    RingRef ring;
} Packer;

static PyObject *Packer_vectorcall(Packer *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames);

static int Packer_init(Packer *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"fmt", "kid", NULL};
    const char *fmt;
    long long kid;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sL", names, &fmt, &kid)) return -1;
    if (parse_format(&self->layout, fmt) < 0 || self->layout.ncodes < 5 ||
        self->layout.codes[self->layout.ncodes - 1] != 'Q' || self->layout.size > RING_SLOT) {
        PyErr_Format(PyExc_ValueError, "unsupported record format %s", fmt);
        return -1;
    }
    self->kid = kid;
    self->vectorcall = (vectorcallfunc)Packer_vectorcall;
    return 0;
}

static void Packer_dealloc(Packer *self) {
    ring_clear(&self->ring);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* packer(ring, step, t0, t1, fields): None once the slot is written (the record, or void and
 * counted in ring.lost when a value does not fit its type even coerced); False when no slot
 * was taken (a ring whose seqs are not held in C: the writer's Python path). */
static int put(Packer *self, PyObject *ring, Value step, Value t0, Value t1, int bad, PyObject *fields) {
    const Layout *layout = &self->layout;
    Py_ssize_t nfields = PyTuple_GET_SIZE(fields);
    if (nfields != layout->ncodes - 5 || ring_set(&self->ring, ring) < 0) return 0;
    Value values[MAX_FIELDS];
    values[0].i = self->kid;
    values[1] = step;
    values[2] = t0;
    values[3] = t1;
    for (Py_ssize_t i = 0; i < nfields; i++) values[4 + i] = as_value(PyTuple_GET_ITEM(fields, i), layout->codes[4 + i], &bad);
    put_record(&self->ring, layout, values, bad);
    return 1;
}

static PyObject *Packer_vectorcall(Packer *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 5 || kwnames != NULL || !PyTuple_Check(argv[4])) {
        PyErr_SetString(PyExc_TypeError, "Packer(ring, step, t0, t1, fields: tuple)");
        return NULL;
    }
    int bad = 0;
    Value step = as_value(argv[1], 'q', &bad), t0 = as_value(argv[2], 'q', &bad), t1 = as_value(argv[3], 'q', &bad);
    if (!put(self, argv[0], step, t0, t1, bad, argv[4])) Py_RETURN_FALSE;
    Py_RETURN_NONE;
}

int packer_put(PyObject *packer, PyObject *ring, int64_t step, int64_t t0, int64_t t1, PyObject *fields) {
    if (Py_TYPE(packer) != &PackerType || !PyTuple_Check(fields)) return 0;
    Value vs = {.i = step}, v0 = {.i = t0}, v1 = {.i = t1};
    return put((Packer *)packer, ring, vs, v0, v1, 0, fields);
}


/* packer.many(ring, notes: bytes): pack records given as int64 rows (step, t0, t1, fields...),
 * the C++ bucket timer's notes. None once all are packed (a row with a value its field cannot
 * hold leaves its slot void, counted in ring.lost); else 0: no slot could be taken (a ring
 * whose seqs are not held in C: the writer packs the rows). */
static PyObject *Packer_many(Packer *self, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "many(ring, notes: bytes)");
        return NULL;
    }
    const Layout *layout = &self->layout;
    Py_ssize_t width = layout->ncodes - 2, size = PyBytes_GET_SIZE(argv[1]); /* less kind id and seq */
    if (width < 3 || size % (width * 8)) {
        PyErr_SetString(PyExc_ValueError, "many: notes are not whole rows of this kind");
        return NULL;
    }
    if (ring_set(&self->ring, argv[0]) < 0) return PyLong_FromLong(0);
    const char *data = PyBytes_AS_STRING(argv[1]);
    for (Py_ssize_t row = 0; row < size / (width * 8); row++) {
        Value values[MAX_FIELDS];
        values[0].i = self->kid;
        for (Py_ssize_t i = 0; i < width; i++) {
            memcpy(&values[1 + i].i, data + (row * width + i) * 8, 8);
            if (layout->codes[1 + i] == 'd') values[1 + i].d = (double)values[1 + i].i;
        }
        put_record(&self->ring, layout, values, 0);
    }
    Py_RETURN_NONE;
}

static PyMethodDef Packer_methods[] = {
    {"many", (PyCFunction)(void (*)(void))Packer_many, METH_FASTCALL, "Pack int64 rows (step, t0, t1, fields...)."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject PackerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.probes._fast.Packer",
    .tp_basicsize = sizeof(Packer),
    .tp_vectorcall_offset = offsetof(Packer, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Packs one kind's events into the ring (see trace/writer.py's pack).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Packer_init,
    .tp_dealloc = (destructor)Packer_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_methods = Packer_methods,
};
