/* The trace writer's pack (trace/writer.py) in C: one event of one kind into the ring, or the
 * C++ bucket timer's notes many at once (see _fast.c for the layout and the ring). */
#include "_fast.h"

/* A Python value as the value of a field of type ``code``, as struct would take it. */
static Value as_value(PyObject *v, char code, int *bad) {
    Value out;
    if (code == 'd') {
        out.d = PyFloat_AsDouble(v);
        if (out.d == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            *bad = 1;
        }
    } else {
        out.i = as_i64(v, bad);
    }
    return out;
}

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

/* packer(ring, step, t0, t1, fields): None once packed; (offset, seq) of a slot taken whose
 * values did not all fit, for the writer's pack_odd; False when no slot was taken. */
static PyObject *Packer_vectorcall(Packer *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 5 || kwnames != NULL || !PyTuple_Check(argv[4])) {
        PyErr_SetString(PyExc_TypeError, "Packer(ring, step, t0, t1, fields: tuple)");
        return NULL;
    }
    PyObject *fields = argv[4];
    const Layout *layout = &self->layout;
    Py_ssize_t nfields = PyTuple_GET_SIZE(fields);
    if (ring_set(&self->ring, argv[0]) < 0) Py_RETURN_FALSE;
    Value values[MAX_FIELDS];
    int bad = nfields != layout->ncodes - 5;
    values[0].i = self->kid;
    for (int i = 1; i < 4; i++) values[i].i = as_i64(argv[i], &bad);
    for (Py_ssize_t i = 0; i < nfields && !bad; i++)
        values[4 + i] = as_value(PyTuple_GET_ITEM(fields, i), layout->codes[4 + i], &bad);
    Py_ssize_t at;
    PyObject *n_obj = take_slot(&self->ring, &at);
    if (n_obj == NULL) Py_RETURN_FALSE;
    if (write_slot(&self->ring, layout, values, bad, n_obj, at)) {
        head_to(&self->ring, n_obj);
        Py_DECREF(n_obj);
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(nN)", at, n_obj);
}


/* packer.many(ring, notes: bytes): pack records given as int64 rows (step, t0, t1, fields...),
 * the C++ bucket timer's notes. None once all are packed; a list of (offset, seq, row) for the
 * rows whose slot was taken but whose values did not all fit (the writer's pack_odd fills
 * them); the index of the first row no slot could be taken for (the writer packs those). */
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
    PyObject *odd = NULL;
    for (Py_ssize_t row = 0; row < size / (width * 8); row++) {
        Value values[MAX_FIELDS];
        values[0].i = self->kid;
        for (Py_ssize_t i = 0; i < width; i++) {
            memcpy(&values[1 + i].i, data + (row * width + i) * 8, 8);
            if (layout->codes[1 + i] == 'd') values[1 + i].d = (double)values[1 + i].i;
        }
        Py_ssize_t at;
        PyObject *n_obj = take_slot(&self->ring, &at);
        if (n_obj == NULL) {
            Py_XDECREF(odd);
            return PyLong_FromSsize_t(row); /* rows before this one are packed */
        }
        if (write_slot(&self->ring, layout, values, 0, n_obj, at)) {
            head_to(&self->ring, n_obj);
            Py_DECREF(n_obj);
            continue;
        }
        PyObject *item = Py_BuildValue("(nNn)", at, n_obj, row);
        if (item == NULL || (odd == NULL && (odd = PyList_New(0)) == NULL) || PyList_Append(odd, item) < 0) {
            Py_XDECREF(item);
            Py_XDECREF(odd);
            return NULL;
        }
        Py_DECREF(item);
    }
    return odd ? odd : Py_NewRef(Py_None);
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
