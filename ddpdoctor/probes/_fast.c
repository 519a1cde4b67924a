/* The probes' hot paths in C (probes/fastpath.py says when they run):
 *
 * - Collective: what probes/collectives.py does in Python for a call it has seen before (same
 *   instruction, group, tensor dtype and size), without a Python frame, a tuple of fields or
 *   a dozen integer objects per event. Called as fast(args, kwargs) by the Python wrapper that
 *   replaced torch.distributed's function (it stays Python so that torch.compile still inlines
 *   it and sees torch.compiler.is_compiling()); every other case goes to that path,
 *   ``slow(*args, **kwargs)``: a new call site, a non-tensor first argument.
 * - Packer: the trace writer's pack (trace/writer.py) of one event of one kind into the ring.
 * - site(): the call-site lookup of probes/callsite.py for a call made from an instruction
 *   whose site is known; None sends the caller to the Python walk, which learns it.
 *
 * A record is packed by the layout of the ``struct`` format the Python writer packs the same
 * kind with (trace/ring.py's slot_struct), parsed once here: the format stays the one
 * declaration. A value that does not fit its type goes to the writer's pack_odd, as in Python.
 * The slot's seq, its last value, is stored last, as the Python path does, so that a slot
 * caught mid-write by a death keeps its old seq.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the trace's records are little-endian: build without this module (the Python path)"
#endif

#define MAX_FIELDS 32
#define RING_HEADER 64 /* trace/ring.py's HEADER_BYTES and SLOT, checked against it at import */
#define RING_SLOT 128

/* A record's layout: one struct code and offset per value (kind id, step, t0, t1, fields...,
 * seq last). */
typedef struct {
    int ncodes, size;
    char codes[MAX_FIELDS];
    int offsets[MAX_FIELDS];
} Layout;

/* The ring last written, as the writer holds it for its life: its mapping, seq counter, mask. */
typedef struct {
    PyObject *ring, *mm, *next;
    long long mask;
} RingRef;

typedef union {
    int64_t i;
    double d;
} Value;

/* Names looked up on each call, interned once. */
static PyObject *s_active, *s_in_bucket_hook, *s_disabled, *s_progress, *s_calls, *s_step, *s_events,
    *s_writer, *s_ring, *s_mm, *s_mask, *s_next, *s_head, *s_dtype, *s_nbytes, *s_group, *s_async_op,
    *s_collectives, *s_raised, *s_pack_odd, *s_collective_kind, *one;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *orig;       /* torch's function */
    PyObject *slow;       /* the Python wrapper's whole path: slow(*args, **kwargs) */
    PyObject *failed;     /* failed(collector, exc): the probe broke before the call */
    PyObject *of_frame;   /* callsite.of_frame(collector, frame) -> (site, direct) */
    PyObject *globals;    /* probes/collector.py's module dict: its ACTIVE */
    PyObject *tensor;     /* torch.Tensor */
    PyObject *phase;      /* LivePhase.COLLECTIVE */
    PyObject *op;         /* "all_reduce" */
    PyObject *kind;       /* schema.COLLECTIVE, for the raised record */
    PyObject *root_names; /* keyword names of the root rank (tuple), or None */
    int always_async, root_pos, root_default, depth;
    Layout layout;
    /* The last call site: its key's values and what the Python path described it as (its
     * entry in the collector's ``calls``), so that a call in a loop builds no key and looks
     * nothing up. Strong references: no address compared here can be reused while held. */
    PyObject *last_c, *last_known, *last_code, *last_group, *last_dtype;
    int last_lasti, last_async;
    long long last_root, last_nbytes;
    RingRef ring;
    PyObject *kid_c; /* the collector whose collective kind id this is */
    long long kid;
} Collective;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic_ns's clock */
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* A struct format of codes x H b i I q Q d with counts, little-endian ("<"): the offset of
 * each value. Returns -1 on a format this file does not know. */
static int parse_format(Layout *self, const char *fmt) {
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

/* Store one value by its code; 0 when it does not fit (the Python path then coerces it). */
static int store(char *base, char code, int offset, Value value) {
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

static int64_t as_i64(PyObject *v, int *bad) {
    int overflow = 0;
    long long x = PyLong_Check(v) ? PyLong_AsLongLongAndOverflow(v, &overflow) : 0;
    if (!PyLong_Check(v) || overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *bad = 1;
        return 0;
    }
    return x;
}

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

static void ring_clear(RingRef *r) {
    Py_CLEAR(r->ring); Py_CLEAR(r->mm); Py_CLEAR(r->next);
}

/* Point ``r`` at ``ring`` (looked up again only when the ring changes); -1 when it is not one. */
static int ring_set(RingRef *r, PyObject *ring) {
    if (ring == r->ring) return 0;
    int bad = 0;
    PyObject *mask = PyObject_GetAttr(ring, s_mask);
    PyObject *mm = mask ? PyObject_GetAttr(ring, s_mm) : NULL;
    PyObject *next = mm ? PyObject_GetAttr(ring, s_next) : NULL;
    long long m = mask ? as_i64(mask, &bad) : 0;
    Py_XDECREF(mask);
    if (next == NULL || bad) {
        Py_XDECREF(mm); Py_XDECREF(next);
        PyErr_Clear();
        return -1;
    }
    ring_clear(r);
    Py_INCREF(ring);
    r->ring = ring; r->mm = mm; r->next = next; r->mask = m;
    return 0;
}

/* Take the ring's next slot: its seq (a new reference), or NULL when none was taken (then
 * nothing is owed to the writer). Once a slot is taken it must be written, or the writer
 * thread would wait for it: by ``write_slot``, else by the writer's pack_odd. */
static PyObject *take_slot(RingRef *r, Py_ssize_t *at) {
    PyObject *n_obj = PyObject_CallNoArgs(r->next);
    int bad = 0;
    long long n = n_obj ? as_i64(n_obj, &bad) : 0;
    if (n_obj == NULL || bad) {
        Py_XDECREF(n_obj);
        PyErr_Clear();
        return NULL;
    }
    *at = RING_HEADER + (Py_ssize_t)(n & r->mask) * RING_SLOT;
    return n_obj;
}

/* Write ``values`` (all but the seq) and then the seq into the slot at ``at``. 1: written or
 * lost with an unmapped ring (a late event after close); 0: a value does not fit its type. */
static int write_slot(RingRef *r, const Layout *layout, const Value *values, int bad, PyObject *n_obj,
                      Py_ssize_t at) {
    Py_buffer view;
    if (PyObject_GetBuffer(r->mm, &view, PyBUF_WRITABLE) < 0) {
        PyErr_Clear(); /* a ring unmapped by close under a late event: that event is lost */
        return 1;
    }
    if (!bad && at + layout->size <= view.len) {
        char *base = (char *)view.buf + at;
        for (int i = 0; i < layout->ncodes - 1 && !bad; i++)
            if (!store(base, layout->codes[i], layout->offsets[i], values[i])) bad = 1;
        if (!bad) {
            uint64_t seq = (uint64_t)PyLong_AsUnsignedLongLong(n_obj);
            __atomic_signal_fence(__ATOMIC_SEQ_CST); /* the record first, then its seq */
            memcpy(base + layout->offsets[layout->ncodes - 1], &seq, 8);
        }
    } else {
        bad = 1;
    }
    PyBuffer_Release(&view);
    return !bad;
}

static void head_to(RingRef *r, PyObject *n_obj) {
    if (PyObject_SetAttr(r->ring, s_head, n_obj) < 0) PyErr_Clear();
}

/* ------------------------------------------------------------------ Packer */

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
    PyObject *calls = argv[1], *is_user = argv[2], *found = Py_None;
    PyFrameObject *frame = PyEval_GetFrame();
    Py_XINCREF(frame);
    for (long i = 0; i < depth && frame; i++) Py_SETREF(frame, PyFrame_GetBack(frame));
    for (int hop = 0; frame && hop < 64; hop++) {
        /* is_user[id(code)] = (is it the user's, code); calls[(id(code), instruction)] = site,
         * for user frames only */
        PyCodeObject *code = PyFrame_GetCode(frame);
        PyObject *code_id = PyLong_FromVoidPtr(code);
        Py_DECREF(code);
        PyObject *mine = code_id ? PyDict_GetItemWithError(is_user, code_id) : NULL;
        int user = mine && PyTuple_Check(mine) && PyTuple_GET_SIZE(mine) >= 1 ? PyObject_IsTrue(PyTuple_GET_ITEM(mine, 0)) : -1;
        if (user == 0) { /* a library's frame: its caller's */
            Py_DECREF(code_id);
            Py_SETREF(frame, PyFrame_GetBack(frame));
            continue;
        }
        if (user == 1) { /* the user's frame: its site, if this instruction's is known */
            PyObject *key = Py_BuildValue("(Oi)", code_id, PyFrame_GetLasti(frame));
            PyObject *sid = key ? PyDict_GetItemWithError(calls, key) : NULL;
            Py_XDECREF(key);
            if (sid != NULL) found = sid;
        }
        Py_XDECREF(code_id);
        break; /* a frame not seen yet, or an instruction not learnt yet: the Python walk's */
    }
    Py_XDECREF(frame);
    if (PyErr_Occurred()) return NULL;
    return Py_NewRef(found);
}

/* ------------------------------------------------------------------ Collective */

static PyObject *Collective_vectorcall(Collective *self, PyObject *const *argv, size_t nargsf,
                                       PyObject *kwnames);

static void Collective_dealloc(Collective *self) {
    Py_XDECREF(self->orig); Py_XDECREF(self->slow); Py_XDECREF(self->failed);
    Py_XDECREF(self->of_frame); Py_XDECREF(self->globals); Py_XDECREF(self->tensor);
    Py_XDECREF(self->phase); Py_XDECREF(self->op); Py_XDECREF(self->kind); Py_XDECREF(self->root_names);
    Py_XDECREF(self->last_c); Py_XDECREF(self->last_known); Py_XDECREF(self->last_code);
    Py_XDECREF(self->last_group); Py_XDECREF(self->last_dtype);
    ring_clear(&self->ring);
    Py_XDECREF(self->kid_c);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Collective_init(Collective *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"orig", "slow", "failed", "of_frame", "globals", "tensor", "phase", "op",
                            "kind", "fmt", "always_async", "root_pos", "root_names", "root_default",
                            "depth", NULL};
    PyObject *orig, *slow, *failed, *of_frame, *globals, *tensor, *phase, *op, *kind, *root_names;
    const char *fmt;
    int always_async, root_pos, root_default, depth;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO!OOUUspiOii", names, &orig, &slow, &failed,
                                     &of_frame, &PyDict_Type, &globals, &tensor, &phase, &op, &kind,
                                     &fmt, &always_async, &root_pos, &root_names, &root_default, &depth))
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
    SET(globals, globals); SET(tensor, tensor); SET(phase, phase); SET(op, op); SET(kind, kind);
    SET(root_names, root_names);
#undef SET
    self->always_async = always_async;
    self->root_pos = root_pos;
    self->root_default = root_default;
    self->depth = depth;
    self->vectorcall = (vectorcallfunc)Collective_vectorcall;
    return 0;
}

/* type(obj).__name__ is one of the process group classes (the Python path's _is_group). */
static int is_group(PyObject *obj) {
    const char *name = Py_TYPE(obj)->tp_name;
    const char *dot = strrchr(name, '.');
    if (dot) name = dot + 1;
    return !strcmp(name, "ProcessGroup") || !strcmp(name, "ProcessGroupGloo") ||
           !strcmp(name, "ProcessGroupNCCL");
}

/* The root rank as the Python path's _root finds it; -2 with an error set on failure. */
static long long root_of(Collective *self, PyObject *args, PyObject *kwargs) {
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


/* Point self->ring at the ring the writer holds now, and know the collective's kind id (looked
 * up again only when the collector changes). -1 when there is nothing to write to. */
static int ring_now(Collective *self, PyObject *c, PyObject *d) {
    PyObject *writer = PyDict_GetItemWithError(d, s_writer);
    PyObject *ring = writer ? PyObject_GetAttr(writer, s_ring) : NULL;
    int ok = ring != NULL && ring != Py_None && ring_set(&self->ring, ring) == 0;
    Py_XDECREF(ring);
    if (!ok) return -1;
    if (c != self->kid_c) {
        int bad = 0;
        PyObject *kind = PyObject_GetAttr(c, s_collective_kind);
        PyObject *kid = kind ? PyObject_GetAttrString(kind, "kid") : NULL;
        long long k = kid ? as_i64(kid, &bad) : 0;
        Py_XDECREF(kind); Py_XDECREF(kid);
        if (kid == NULL || bad) return -1;
        Py_INCREF(c);
        Py_XSETREF(self->kid_c, c);
        self->kid = k;
    }
    return 0;
}

/* writer.pack_odd(kind, ring, at, (step, t0, t1), fields, n): a value that does not fit its
 * type, coerced, or the slot voided, as the Python path does. */
static void pack_odd(PyObject *c, PyObject *ring, Py_ssize_t at, PyObject *n_obj, PyObject *step,
                     int64_t t0, int64_t t1, PyObject *known, PyObject *seq, PyObject *site, int async_) {
    PyObject *writer = PyObject_GetAttr(c, s_writer);
    PyObject *kind = writer ? PyObject_GetAttr(c, s_collective_kind) : NULL;
    PyObject *head = kind ? Py_BuildValue("(OLL)", step, (long long)t0, (long long)t1) : NULL;
    PyObject *fields = head ? Py_BuildValue("(OOOOOiOO)", PyTuple_GET_ITEM(known, 5), PyTuple_GET_ITEM(known, 3),
                                            PyTuple_GET_ITEM(known, 6), PyTuple_GET_ITEM(known, 2), seq, async_,
                                            site, PyTuple_GET_ITEM(known, 9)) : NULL;
    PyObject *at_obj = fields ? PyLong_FromSsize_t(at) : NULL;
    PyObject *r = at_obj ? PyObject_CallMethodObjArgs(writer, s_pack_odd, kind, ring, at_obj, head, fields,
                                                      n_obj, NULL) : NULL;
    Py_XDECREF(r); Py_XDECREF(at_obj); Py_XDECREF(fields); Py_XDECREF(head); Py_XDECREF(kind);
    Py_XDECREF(writer);
    PyErr_Clear();
}

/* The record of a call that returned, into the ring's next slot (the Python path's inlined
 * pack). */
static void record(Collective *self, PyObject *c, PyObject *d, PyObject *known, PyObject *seq_obj,
                   PyObject *site_obj, int async_, int64_t t0, int64_t t1) {
    PyObject *step = PyDict_GetItemWithError(d, s_step);
    if (step == NULL || ring_now(self, c, d) < 0) return;
    PyObject *ring = Py_NewRef(self->ring.ring);
    int bad = 0;
    /* kind id, step, t0, t1, then the fields in schema.COLLECTIVE's order: op, bytes, group,
     * group size, seq, async, site, signature */
    Value values[12];
    values[0].i = self->kid;
    values[1].i = as_i64(step, &bad);
    values[2].i = t0;
    values[3].i = t1;
    values[4].i = as_i64(PyTuple_GET_ITEM(known, 5), &bad);
    values[5].i = as_i64(PyTuple_GET_ITEM(known, 3), &bad);
    values[6].i = as_i64(PyTuple_GET_ITEM(known, 6), &bad);
    values[7].i = as_i64(PyTuple_GET_ITEM(known, 2), &bad);
    values[8].i = as_i64(seq_obj, &bad);
    values[9].i = async_;
    values[10].i = as_i64(site_obj, &bad);
    values[11].i = as_i64(PyTuple_GET_ITEM(known, 9), &bad);
    Py_ssize_t at;
    PyObject *n_obj = take_slot(&self->ring, &at);
    if (n_obj != NULL) {
        if (!write_slot(&self->ring, &self->layout, values, bad, n_obj, at))
            pack_odd(c, ring, at, n_obj, step, t0, t1, known, seq_obj, site_obj, async_);
        if (PyObject_SetAttr(ring, s_head, n_obj) < 0) PyErr_Clear();
        Py_DECREF(n_obj);
    }
    Py_DECREF(ring);
}

static PyObject *passthrough(Collective *self, PyObject *args, PyObject *kwargs) {
    return PyObject_Call(self->orig, args, kwargs);
}

/* The probe broke before the call: failed(c, exc) logs it and switches the probe off (or
 * re-raises what a signal handler raised); then torch's function runs unrecorded. */
static PyObject *broke(Collective *self, PyObject *c, PyObject *args, PyObject *kwargs) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL; /* KeyboardInterrupt: the program's */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb) PyException_SetTraceback(value, tb);
    PyObject *r = PyObject_CallFunctionObjArgs(self->failed, c, value, NULL);
    Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    return passthrough(self, args, kwargs);
}

/* What the Python path described this call as (a new reference), or NULL: a new call site
 * (no error set), or an error. The last call site is compared by value first. */
static PyObject *known_call(Collective *self, PyObject *c, PyObject *d, PyObject *frame, PyObject *head,
                            PyObject *group, int async_, long long root) {
    PyCodeObject *code = PyFrame_GetCode((PyFrameObject *)frame);
    int lasti = PyFrame_GetLasti((PyFrameObject *)frame);
    PyObject *dtype = PyObject_GetAttr(head, s_dtype);
    PyObject *nbytes = dtype ? PyObject_GetAttr(head, s_nbytes) : NULL;
    PyObject *known = NULL, *key = NULL;
    int bad = 0;
    long long nb = nbytes ? as_i64(nbytes, &bad) : 0;
    if (nbytes == NULL || bad) goto out;
    if (self->last_known && c == self->last_c && (PyObject *)code == self->last_code &&
        lasti == self->last_lasti && group == self->last_group && async_ == self->last_async &&
        root == self->last_root && dtype == self->last_dtype && nb == self->last_nbytes) {
        known = self->last_known;
        Py_INCREF(known);
        goto out;
    }
    /* the Python path's key: (id(code), f_lasti, group, async, root, dtype, nbytes) */
    key = Py_BuildValue("(NiOiLOO)", PyLong_FromVoidPtr(code), lasti, group, async_, root, dtype, nbytes);
    PyObject *calls = key ? PyDict_GetItemWithError(d, s_calls) : NULL;
    if (calls == NULL || !PyDict_Check(calls)) goto out;
    known = PyDict_GetItemWithError(calls, key);
    if (known == NULL || !PyTuple_Check(known) || PyTuple_GET_SIZE(known) != 13) {
        known = NULL;
        goto out;
    }
    Py_INCREF(known);
    Py_INCREF(c); Py_XSETREF(self->last_c, c);
    Py_INCREF(known); Py_XSETREF(self->last_known, known);
    Py_INCREF(code); Py_XSETREF(self->last_code, (PyObject *)code);
    Py_INCREF(group); Py_XSETREF(self->last_group, group);
    Py_INCREF(dtype); Py_XSETREF(self->last_dtype, dtype);
    self->last_lasti = lasti;
    self->last_async = async_;
    self->last_root = root;
    self->last_nbytes = nb;
out:
    Py_DECREF(code);
    Py_XDECREF(dtype);
    Py_XDECREF(nbytes);
    Py_XDECREF(key);
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
    PyObject *c = PyDict_GetItemWithError(self->globals, s_active); /* borrowed */
    if (c == NULL || c == Py_None) {
        if (PyErr_Occurred()) return NULL;
        return passthrough(self, args, kwargs);
    }
    Py_INCREF(c);
    PyObject *d = NULL, *frame = NULL, *prev = NULL, *known = NULL, *site_obj = NULL, *seq_obj = NULL;
    PyObject *progress = NULL, *result = NULL, *group = Py_None;
    int async_ = self->always_async;
    long long root = -1;

    d = PyObject_GenericGetDict(c, NULL);
    if (d == NULL) goto broken;
    PyObject *in_hook = PyDict_GetItemWithError(d, s_in_bucket_hook);
    PyObject *disabled = in_hook ? PyDict_GetItemWithError(d, s_disabled) : NULL;
    if (disabled == NULL || !PySet_Check(disabled)) goto slow;
    if (PyObject_IsTrue(in_hook) != 0 || PySet_Contains(disabled, s_collectives) != 0) goto plain;
    prev = PyDict_GetItemWithError(d, s_progress);
    if (prev == NULL) goto slow;
    Py_INCREF(prev);
    if (PyTuple_Check(prev) && PyTuple_GET_SIZE(prev) > 0 && PyTuple_GET_ITEM(prev, 0) == self->phase)
        goto plain; /* inside a recorded collective: part of it */

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
            if (is_group(PyTuple_GET_ITEM(args, i))) { group = PyTuple_GET_ITEM(args, i); break; }
    }
    if (self->root_names != Py_None && (root = root_of(self, args, kwargs)) == -2 && PyErr_Occurred())
        goto broken;
    if (nargs < 1) goto slow;
    PyObject *head = PyTuple_GET_ITEM(args, 0);
    int is_tensor = PyObject_IsInstance(head, self->tensor);
    if (is_tensor <= 0) goto broken_or_slow;

    frame = (PyObject *)PyEval_GetFrame();
    Py_XINCREF(frame);
    for (int i = 0; i < self->depth && frame; i++)
        Py_SETREF(frame, (PyObject *)PyFrame_GetBack((PyFrameObject *)frame));
    if (frame == NULL) goto slow;
    known = known_call(self, c, d, frame, head, group, async_, root);
    if (known == NULL) goto broken_or_slow; /* a new call site: the Python path describes it */
    /* (pg, gname, gsize, nbytes, sig, op_id, gid, async, site, sid, seq_of, walk, code) */
    site_obj = PyTuple_GET_ITEM(known, 8);
    Py_INCREF(site_obj);
    int walk = PyObject_IsTrue(PyTuple_GET_ITEM(known, 11));
    if (walk < 0) goto broken;
    if (walk) { /* called from a library: whose line called it varies */
        PyObject *found = PyObject_CallFunctionObjArgs(self->of_frame, c, frame, NULL);
        if (found == NULL || !PyTuple_Check(found) || PyTuple_GET_SIZE(found) < 1) {
            Py_XDECREF(found);
            goto broken_or_slow;
        }
        Py_SETREF(site_obj, Py_NewRef(PyTuple_GET_ITEM(found, 0)));
        Py_DECREF(found);
    }
    seq_obj = PyObject_CallNoArgs(PyTuple_GET_ITEM(known, 10));
    if (seq_obj == NULL) goto broken;

    int64_t t0 = now_ns();
    PyObject *t0_obj = PyLong_FromLongLong(t0);
    progress = t0_obj ? PyTuple_Pack(9, self->phase, self->op, seq_obj, t0_obj, PyTuple_GET_ITEM(known, 1),
                                     PyTuple_GET_ITEM(known, 2), PyTuple_GET_ITEM(known, 3),
                                     PyTuple_GET_ITEM(known, 0), PyTuple_GET_ITEM(known, 4))
                      : NULL;
    Py_XDECREF(t0_obj);
    if (progress == NULL || PyDict_SetItem(d, s_progress, progress) < 0) goto broken;
    result = PyObject_Call(self->orig, args, kwargs);
    if (result == NULL) {
        /* c.raised(prev, kind, op, nbytes, gname, gsize, seq, async, site, sid); then re-raise */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *async_obj = PyLong_FromLong(async_);
        PyObject *r = async_obj ? PyObject_CallMethodObjArgs(
            c, s_raised, prev, self->kind, self->op, PyTuple_GET_ITEM(known, 3), PyTuple_GET_ITEM(known, 1),
            PyTuple_GET_ITEM(known, 2), seq_obj, async_obj, site_obj, PyTuple_GET_ITEM(known, 9), NULL) : NULL;
        Py_XDECREF(async_obj);
        if (r == NULL) { /* the patient's exception is the one that goes on */
            PyErr_Clear();
            if (PyDict_SetItem(d, s_progress, prev) < 0) PyErr_Clear();
        }
        Py_XDECREF(r);
        PyErr_Restore(type, value, tb);
        goto done;
    }
    int64_t t1 = now_ns();
    if (PyDict_SetItem(d, s_progress, prev) == 0) {
        PyObject *events = PyDict_GetItemWithError(d, s_events);
        PyObject *more = events ? PyNumber_Add(events, one) : NULL;
        if (more != NULL && PyDict_SetItem(d, s_events, more) == 0)
            record(self, c, d, known, seq_obj, site_obj, async_, t0, t1);
        Py_XDECREF(more);
    }
    PyErr_Clear(); /* the call returned: a record we could not make is lost, never the result */
    goto done;

broken_or_slow:
    if (!PyErr_Occurred()) goto slow;
broken:
    if (PyErr_Occurred()) {
        result = broke(self, c, args, kwargs);
        goto done;
    }
slow:
    result = PyObject_Call(self->slow, args, kwargs);
    goto done;
plain:
    if (PyErr_Occurred()) goto broken;
    result = passthrough(self, args, kwargs);
done:
    Py_XDECREF(progress);
    Py_XDECREF(seq_obj);
    Py_XDECREF(site_obj);
    Py_XDECREF(known);
    Py_XDECREF(frame);
    Py_XDECREF(prev);
    Py_XDECREF(d);
    Py_DECREF(c);
    return result;
}

static PyTypeObject CollectiveType = {
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

static PyTypeObject PackerType = {
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
};

static PyMethodDef functions[] = {
    {"site", (PyCFunction)(void (*)(void))site, METH_FASTCALL, "The call site callsite.py has learnt, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fast", "The probes' hot paths in C (probes/fastpath.py).", -1,
    functions, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fast(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_active, "ACTIVE"); INTERN(s_in_bucket_hook, "in_bucket_hook"); INTERN(s_disabled, "disabled");
    INTERN(s_progress, "progress"); INTERN(s_calls, "calls"); INTERN(s_step, "step");
    INTERN(s_events, "events"); INTERN(s_writer, "writer"); INTERN(s_ring, "ring"); INTERN(s_mm, "mm");
    INTERN(s_mask, "mask"); INTERN(s_next, "next"); INTERN(s_head, "head"); INTERN(s_dtype, "dtype");
    INTERN(s_nbytes, "nbytes"); INTERN(s_group, "group"); INTERN(s_async_op, "async_op");
    INTERN(s_collectives, "collectives"); INTERN(s_raised, "raised"); INTERN(s_pack_odd, "pack_odd");
    INTERN(s_collective_kind, "collective_kind");
#undef INTERN
    if ((one = PyLong_FromLong(1)) == NULL) return NULL;
    if (PyType_Ready(&CollectiveType) < 0 || PyType_Ready(&PackerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Collective", (PyObject *)&CollectiveType) < 0 ||
        PyModule_AddObjectRef(m, "Packer", (PyObject *)&PackerType) < 0 ||
        PyModule_AddIntConstant(m, "RING_HEADER", RING_HEADER) < 0 ||
        PyModule_AddIntConstant(m, "RING_SLOT", RING_SLOT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
