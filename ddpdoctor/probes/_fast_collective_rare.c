/* The collective probe's rare paths (see _fast_collective.h). */
#include "_fast_collective.h"

/* type(obj).__name__ is one of the process group classes (the Python path's _is_group). */
int coll_is_group(PyObject *obj) {
    const char *name = Py_TYPE(obj)->tp_name;
    const char *dot = strrchr(name, '.');
    if (dot) name = dot + 1;
    return !strcmp(name, "ProcessGroup") || !strcmp(name, "ProcessGroupGloo") ||
           !strcmp(name, "ProcessGroupNCCL");
}

/* The root rank as the Python path's _root finds it; -2 with an error set on failure. */
long long coll_root_of(Collective *self, PyObject *args, PyObject *kwargs) {
    if (kwargs) {
        Py_ssize_t n = PyTuple_GET_SIZE(self->root_names);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(self->root_names, i));
            if (v == NULL) {
                if (PyErr_Occurred()) return -2;
                continue;
            }
            if (v == Py_None) continue;
            PyObject *as_int = PyNumber_Long(v);
            if (as_int == NULL) return -2;
            long long r = PyLong_AsLongLong(as_int);
            Py_DECREF(as_int);
            if (r == -1 && PyErr_Occurred()) return -2;
            return r;
        }
    }
    if (PyTuple_GET_SIZE(args) > self->root_pos) {
        PyObject *v = PyTuple_GET_ITEM(args, self->root_pos);
        if (PyLong_Check(v)) {
            long long r = PyLong_AsLongLong(v);
            if (r == -1 && PyErr_Occurred()) return -2;
            return r;
        }
    }
    return self->root_default;
}


/* Know the collector's collective kind id (looked up again only when the collector changes):
 * 0, or -1 when it has none. */
COLD int coll_kid_find(Collective *self, State *s) {
    int bad = 0;
    PyObject *kind = s->collective_kind;
    PyObject *kid = kind ? PyObject_GetAttrString(kind, "kid") : NULL;
    long long k = kid ? as_i64(kid, &bad) : 0;
    Py_XDECREF(kid);
    if (kid == NULL || bad) return -1;
    Py_INCREF(s);
    Py_XSETREF(self->kid_c, (PyObject *)s);
    self->kid = k;
    return 0;
}

/* What the Python path described a call site as, stored into a slot image once: the fields of
 * schema.COLLECTIVE that are the call site's (op, bytes, group, group size, site, signature).
 * 1 when one does not fit its type. Its signature and site ids as integers, for enter_call
 * (*ids_bad: one is not an int of 64 bits). */
int coll_image_from(const Layout *layout, PyObject *known, char *image, long long *sid, long long *site,
                      int *ids_bad) {
    static const int at[6] = {4, 5, 6, 7, 10, 11}, from[6] = {5, 3, 6, 2, 8, 9};
    int bad = 0;
    *ids_bad = 0;
    *sid = as_i64(PyTuple_GET_ITEM(known, 9), ids_bad);
    *site = as_i64(PyTuple_GET_ITEM(known, 8), ids_bad);
    memset(image, 0, RING_SLOT);
    for (int i = 0; i < 6 && !bad; i++) {
        char code = layout->codes[at[i]];
        Value v = as_value(PyTuple_GET_ITEM(known, from[i]), code, &bad);
        if (!bad && !store(image, code, layout->offsets[at[i]], v)) bad = 1;
    }
    return bad;
}

/* The probe broke before the call: failed(c, exc) logs it and switches the probe off (or
 * re-raises what a signal handler raised); then torch's function runs unrecorded. */
COLD PyObject *coll_broke(Collective *self, PyObject *c, PyObject *args, PyObject *kwargs) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL; /* KeyboardInterrupt: the program's */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb) PyException_SetTraceback(value, tb);
    PyObject *r = PyObject_CallFunctionObjArgs(self->failed, c, value, NULL);
    Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    return PyObject_Call(self->orig, args, kwargs);
}

/* A call not the last one: what the Python path described it as (a new reference, remembered
 * as the last call), or NULL: a new call site (no error set), or an error. */
COLD PyObject *coll_learn_call(Collective *self, PyObject *c, PyObject *calls, PyObject *code, int lasti,
                                 PyObject *group, int async_, long long root, PyObject *dtype, int64_t nb) {
    /* the Python path's key: (id(code), f_lasti, group, async, root, dtype, nbytes) */
    PyObject *key = Py_BuildValue("(NiOiLOL)", PyLong_FromVoidPtr(code), lasti, group, async_, root, dtype,
                                  (long long)nb);
    PyObject *known = key && calls && PyDict_Check(calls) ? PyDict_GetItemWithError(calls, key) : NULL;
    Py_XDECREF(key);
    if (known == NULL || !PyTuple_Check(known) || PyTuple_GET_SIZE(known) != 13) return NULL;
    Py_INCREF(known);
    Py_INCREF(c); Py_XSETREF(self->last_c, c);
    Py_INCREF(known); Py_XSETREF(self->last_known, known);
    Py_INCREF(code); Py_XSETREF(self->last_code, code);
    Py_INCREF(group); Py_XSETREF(self->last_group, group);
    Py_INCREF(dtype); Py_XSETREF(self->last_dtype, dtype);
    self->last_lasti = lasti;
    self->last_async = async_;
    self->last_root = root;
    self->last_nbytes = nb;
    PyObject *was = self->image_of; /* NULL while the image is written: a thread that runs in
                                      * the meantime (Python in as_value) stores its own */
    self->image_of = NULL;
    self->image_bad = coll_image_from(&self->layout, known, self->image, &self->image_sid, &self->image_site,
                                 &self->ids_bad);
    self->image_of = Py_NewRef(known);
    Py_XDECREF(was);
    return known;
}

/* torch's call raised: c.raised(prev, kind, op, nbytes, gname, gsize, seq, async, site, sid)
 * records it, and the patient's exception goes on, unchanged, whatever happens there. */
COLD void coll_raised(Collective *self, PyObject *c, State *s, Progress *saved, PyObject *known,
                        PyObject *seq_obj, PyObject *site_obj, int async_) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *async_obj = PyLong_FromLong(async_), *prev = progress_object(saved);
    PyObject *r = async_obj && prev ? PyObject_CallMethodObjArgs(
        c, s_raised, prev, self->kind, self->op, PyTuple_GET_ITEM(known, 3), PyTuple_GET_ITEM(known, 1),
        PyTuple_GET_ITEM(known, 2), seq_obj, async_obj, site_obj, PyTuple_GET_ITEM(known, 9), NULL) : NULL;
    Py_XDECREF(async_obj);
    Py_XDECREF(prev);
    if (r == NULL) PyErr_Clear();
    Py_XDECREF(r);
    progress_leave(s, saved); /* what c.raised() set, or what it could not */
    PyErr_Restore(type, value, tb);
}
