/* The recording ring in C (trace/ring.py declares it): a record's layout, parsed from the
 * ``struct`` format the Python writer packs the same kind with (trace/ring.py's slot_struct),
 * so that the format stays the one declaration; values coerced to their types as the writer's
 * pack_odd coerces them (``as_value``); the slots, claimed and written; and RingSeqs, a ring's
 * event numbers and its mapping (ring.py's Seqs), through which every record made in C is
 * written without a Python object. A record that still does not fit leaves its slot void and
 * is counted in the ring's ``lost``. The slot's seq, its last value, is stored last, as the
 * Python path does, so that a slot caught mid-write by a death keeps its old seq. */
#include "_fast.h"
#include <structmember.h>

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

/* take(lo, hi, stale, final, sizes) -> (parts, kept, void): trace/ring.py's Ring.take and
 * group in one call, for the writer thread. The slots numbered lo..hi (fewer than a ring) are
 * copied, then read in seq order; a slot not yet written stops the take there (unless claimed
 * by ``stale`` or before, or the take is ``final``). Of the ``kept`` slots, those that hold
 * their seq go to ``parts``, [(kind id, records' bytes, count)] by kind id ascending, a record
 * of ``sizes[kind id]`` bytes (0: none, left out); ``void``: the rest, overwritten. Numpy does
 * the same in ~15 calls that cost the writer 200-400 µs each flush after its sleep. */
static PyObject *RingSeqs_take(RingSeqs *self, PyObject *args) {
    unsigned long long lo, hi, stale;
    int final;
    PyObject *sizes;
    if (!PyArg_ParseTuple(args, "KKKpO!", &lo, &hi, &stale, &final, &PyTuple_Type, &sizes)) return NULL;
    uint64_t slots = (uint64_t)self->mask + 1;
    if (!self->held || self->view.len < RING_HEADER + (Py_ssize_t)(slots * RING_SLOT) || hi < lo ||
        hi + 1 - lo > slots) {
        PyErr_SetString(PyExc_ValueError, "RingSeqs.take: no mapping, or not a range of its slots");
        return NULL;
    }
    Py_ssize_t n = (Py_ssize_t)(hi + 1 - lo), nk = PyTuple_GET_SIZE(sizes), kept = n, mine = 0;
    char *rows = PyMem_Malloc((size_t)n * RING_SLOT);
    Py_ssize_t *size = PyMem_Calloc((size_t)nk + 1, sizeof(Py_ssize_t)), *count = PyMem_Calloc((size_t)nk + 1, sizeof(Py_ssize_t));
    PyObject *parts = PyList_New(0);
    if (rows == NULL || size == NULL || count == NULL || parts == NULL) goto fail;
    const char *ring = (const char *)self->view.buf + RING_HEADER;
    uint64_t first = lo & (uint64_t)self->mask, head = slots - first < (uint64_t)n ? slots - first : (uint64_t)n;
    memcpy(rows, ring + first * RING_SLOT, head * RING_SLOT);
    memcpy(rows + head * RING_SLOT, ring, ((uint64_t)n - head) * RING_SLOT); /* wrapped round */
    for (Py_ssize_t k = 0; k < nk; k++) {
        size[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, k));
        if (size[k] < 0 || size[k] > RING_SEQ_AT - RING_BODY_AT) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "RingSeqs.take: a record size out of a slot");
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t seq, want = lo + (uint64_t)i;
        memcpy(&seq, rows + i * RING_SLOT + RING_SEQ_AT, 8);
        if (seq < want && want > stale && !final) {
            kept = i;
            break;
        }
        if (seq != want) continue;
        uint16_t kid;
        memcpy(&kid, rows + i * RING_SLOT, 2);
        mine++;
        if (kid < nk && size[kid]) count[kid]++;
    }
    for (Py_ssize_t k = 0; k < nk; k++) {
        if (!count[k]) continue;
        PyObject *data = PyBytes_FromStringAndSize(NULL, count[k] * size[k]);
        if (data == NULL) goto fail;
        char *out = PyBytes_AS_STRING(data);
        for (Py_ssize_t i = 0; i < kept; i++) {
            uint64_t seq;
            uint16_t kid;
            memcpy(&seq, rows + i * RING_SLOT + RING_SEQ_AT, 8);
            memcpy(&kid, rows + i * RING_SLOT, 2);
            if (seq == lo + (uint64_t)i && kid == k) {
                memcpy(out, rows + i * RING_SLOT + RING_BODY_AT, (size_t)size[k]);
                out += size[k];
            }
        }
        PyObject *part = Py_BuildValue("(nNn)", k, data, count[k]);
        if (part == NULL || PyList_Append(parts, part) < 0) {
            Py_XDECREF(part);
            goto fail;
        }
        Py_DECREF(part);
    }
    PyMem_Free(rows);
    PyMem_Free(size);
    PyMem_Free(count);
    return Py_BuildValue("(Nnn)", parts, kept, kept - mine);
fail:
    PyMem_Free(rows);
    PyMem_Free(size);
    PyMem_Free(count);
    Py_XDECREF(parts);
    if (!PyErr_Occurred()) PyErr_NoMemory();
    return NULL;
}

static void RingSeqs_dealloc(RingSeqs *self) {
    if (self->held) PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef RingSeqs_methods[] = {
    {"next", (PyCFunction)RingSeqs_next, METH_NOARGS, "Claim the next seq (from 1)."},
    {"release", (PyCFunction)RingSeqs_release, METH_NOARGS, "Let go of the mapping, before it is closed."},
    {"take", (PyCFunction)RingSeqs_take, METH_VARARGS, "The slots written since the last take, grouped by kind."},
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
