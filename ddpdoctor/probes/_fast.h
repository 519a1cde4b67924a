/* Declarations shared by the probes' C hot paths: _fast.c (the module, the ring, the packer,
 * site()), _fast_packer.c (the packer), _fast_collective.c and _fast_collective_rare.c (the
 * collective probe; its object in _fast_collective.h), _fast_step.c
 * (the backward probe's per-step work), _fast_ddp.c (the DDP forward and backward probes),
 * _fast_opt.c (the optimizer's step hooks) and _fast_state.c (the collector's per-event state). */
#ifndef DDPDOCTOR_FAST_H
#define DDPDOCTOR_FAST_H

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

/* A path taken rarely (an error, a call site seen for the first time): kept out of the hot
 * path's code, so that the lines a recorded call touches after it blocked are few. */
#if defined(__GNUC__)
#define COLD __attribute__((cold, noinline))
#else
#define COLD
#endif

#define MAX_FIELDS 32
#define RING_HEADER 64 /* trace/ring.py's HEADER_BYTES, SLOT and VOID, checked against it at import */
#define RING_SLOT 128
#define RING_VOID 0xFFFF /* the kind id of a slot that holds no event */
#define RING_CALL_AT 32  /* the collective entered last: i64 seq, i32 signature id, i32 site id */
#define RING_BODY_AT 4   /* where a slot's record begins, after its u16 kind id */
#define RING_SEQ_AT 120  /* where a slot's u64 seq is, stored last */

/* A record's layout: one struct code and offset per value (kind id, step, t0, t1, fields...,
 * seq last). */
typedef struct {
    int ncodes, size;
    char codes[MAX_FIELDS];
    int offsets[MAX_FIELDS];
} Layout;

/* A ring's event numbers and its mapping (trace/ring.py's ``seqs``), held in C so that a record
 * is written with no Python object: ``n`` the last seq claimed, ``head`` the last written. The
 * mapping's buffer is held from creation until ``release()``, which the ring calls before it
 * unmaps; a record after that is counted lost. Everything here runs under the GIL: claiming a
 * seq is as atomic as itertools.count was. */
typedef struct {
    PyObject_HEAD
    unsigned long long n, head;
    long long mask;
    Py_buffer view;
    int held;
} RingSeqs;

/* The ring last written, as the writer holds it for its life, and its seqs. */
typedef struct {
    PyObject *ring;
    RingSeqs *seqs;
} RingRef;

typedef union {
    int64_t i;
    double d;
} Value;

/* The collector's per-event state (_fast_state.c): the collector's base class, its fields
 * declared once here, (name, what it holds); the integers are C's, the rest any object. */
#define STATE_INTS(X)                                                                  \
    X(step, "the training step (-1 before the first)")                                 \
    X(events, "events recorded so far: the counter liveness watches move")             \
    X(last_step_ns, "entry of the last training forward")                              \
    X(max_step_ns, "the slowest step seen")                                            \
    X(optimizer_t0, "the running optimizer step's start, 0 when none")                 \
    X(inputs_at, "the next training step whose inputs the Python path counts (data.py)")
#define STATE_OBJECTS(X)                                                               \
    X(disabled, "the probes switched off")                                             \
    X(writer, "the trace writer")                                                      \
    X(in_bucket_hook, "inside a gradient bucket's comm hook")                          \
    X(awaiting_backward, "a grad-mode DDP forward has not had its backward yet")       \
    X(accumulating, "the pace model's last forward ran under no_sync()")               \
    X(step_model, "the DDP model state of the last grad-mode forward")                 \
    X(pace_model, "the model whose grad-mode forwards count steps")                    \
    X(native_step, "the C++ timer's set_step, or None")                                \
    X(native_settling, "drain the C++ timer after each backward")                      \
    X(default_pg, "the default process group")                                         \
    X(optimizer_outer, "weakref to the optimizer whose step began, or None")           \
    X(calls, "per call site and tensor shape, what a collective's records share")      \
    X(collective_kind, "the collective's record kind")                                 \
    X(forward_kind, "the DDP forward's record kind")                                   \
    X(backward_kind, "the DDP backward's record kind")                                 \
    X(optimizer_kind, "the optimizer step's record kind")
#define STATE_INT_FIELD(name, doc) long long name;
#define STATE_OBJECT_FIELD(name, doc) PyObject *name;

/* The sync point the rank is inside (the collector's ``progress``): what Python set there (a
 * tuple, or None), or, while a C probe is inside one, that tuple's parts, built into the tuple
 * only when someone reads it (the live status, about once a second; a Python probe nested in
 * the call). A probe's call then makes no tuple and no time object, and lets none go after the
 * call returns, when the caches are cold (docs/overhead.md, twentieth round). The parts are
 * borrowed from the probe's call, which holds them until it leaves. */
typedef struct {
    PyObject *obj;             /* Python's: a tuple or None; NULL while the parts stand for it */
    PyObject *phase, *op, *seq, *src;
    const signed char *tail;   /* src's items after (phase, op, seq, t0): -1 means the int -1; ends at -2 */
    int64_t t0;
} Progress;

/* What pack_event found the last time, held (C's only): the writer's ring, and each kind's C
 * packer. A writer holds one ring until it closes and the ring lets its mapping go; a kind's
 * packer is made with it (trace/writer.py). Looked up again only when either changes. */
#define PACKERS 4
typedef struct {
    PyObject *writer;
    RingRef ring;
    PyObject *kinds[PACKERS], *packers[PACKERS];
} PackMemo;

typedef struct {
    PyObject_HEAD
    STATE_INTS(STATE_INT_FIELD)
    STATE_OBJECTS(STATE_OBJECT_FIELD)
    Progress progress;
    PackMemo pack;
} State;
extern PyTypeObject StateType;
/* ``c`` as a State, or NULL (not one: the Python path's). */
State *probe_state(PyObject *c);
/* The writer's ring (a new reference), or NULL when it has none (closed); kept in s->pack.ring
 * when its seqs are held here (not the Python path's ring). */
PyObject *ring_of(State *s, PyObject *writer);
/* 0 when s->pack.ring is the writer's ring now, its seqs held here, to write records into;
 * else -1 (no writer, a closed ring, or the Python path's). Every C probe of a state shares it. */
static inline int ring_held(State *s) {
    PackMemo *m = &s->pack;
    if (s->writer != NULL && s->writer == m->writer && m->ring.seqs && m->ring.seqs->held) return 0;
    PyObject *ring = s->writer ? ring_of(s, s->writer) : NULL;
    int kept = ring != NULL && ring == m->ring.ring && s->writer == m->writer;
    Py_XDECREF(ring);
    return kept ? 0 : -1;
}
/* A C probe enters a sync point: the state's progress moves to *saved (its reference with it)
 * and the parts given take its place. */
void progress_enter(State *s, Progress *saved, PyObject *phase, PyObject *op, PyObject *seq, PyObject *src,
                    const signed char *tail, int64_t t0);
/* ... and leaves it: *saved is the state's again; what Python set meanwhile is let go. */
void progress_leave(State *s, Progress *saved);
/* A progress as Python sees it (a new reference; NULL with an error set). */
PyObject *progress_object(const Progress *p);
/* Its phase (borrowed; NULL for None or never set), and whether it was never set. */
PyObject *progress_phase(const Progress *p);
static inline int progress_unset(const Progress *p) { return p->obj == NULL && p->phase == NULL; }
/* Set a state's object field to a new reference to ``v``. */
static inline void set_field(PyObject **field, PyObject *v) { Py_XSETREF(*field, Py_XNewRef(v)); }

/* A module's global as last read, and the version tag its dict had then. */
typedef struct {
    uint64_t tag;
    PyObject *value; /* borrowed: the dict holds it while the tag stands */
} Global;
/* dict[name] (borrowed; NULL, with or without an error, as PyDict_GetItemWithError), read again
 * only when the dict changed: CPython 3.11 gives every change to a dict a new version tag, so
 * an unchanged module costs a compare and one cache line, not a hash lookup (about 120
 * instructions and three or four lines, cold after a collective). Elsewhere the lookup. */
static inline PyObject *global_get(PyObject *dict, PyObject *name, Global *g) {
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
    uint64_t tag = ((PyDictObject *)dict)->ma_version_tag;
    if (g->value != NULL && tag == g->tag) return g->value;
    g->value = PyDict_GetItemWithError(dict, name);
    g->tag = tag;
    return g->value;
#else
    (void)g;
    return PyDict_GetItemWithError(dict, name);
#endif
}

/* Names looked up on each call, interned once. */
extern PyObject *s_active, *s_ring, *s_seqs, *s_dtype, *s_nbytes, *s_group, *s_async_op, *s_collectives,
    *s_raised, *s_lost, *s_seq_method, *s_compiling_flag, *one;


/* Shared by the module's parts (_fast.c). */
int64_t now_ns(void);
int parse_format(Layout *self, const char *fmt);
int64_t as_i64(PyObject *v, int *bad);
void ring_clear(RingRef *r);
int ring_set(RingRef *r, PyObject *ring);
/* Claim the ring's next seq and write the record into its slot (void and counted lost when a
 * value does not fit, or the mapping is gone), the seq last; then head = seq. */
void put_record(RingRef *r, const Layout *layout, const Value *values, int bad);
/* The same from a slot image (the record's bytes before its seq, RING_SLOT of them at most:
 * the fields every record of a call site shares, stored once), with ``values`` stored over it
 * at the fields ``vary`` names (indices into the layout, ending at -1). */
void put_image(RingRef *r, const Layout *layout, const char *image, const int *vary, const Value *values,
               int bad);
Value as_value(PyObject *v, char code, int *bad);
void enter_call(RingRef *r, int64_t seq, int64_t sid, int64_t site);
extern PyTypeObject RingSeqsType;

int store(char *base, char code, int offset, Value value);
PyObject *seq_now(PyObject *group, PyObject *seq_of);
/* The C++ timer's (_fast.c's set_native), NULL until it is loaded: 1 when ``param`` has no
 * gradient, 0 when it has, -1 when Python must say; the step its bucket notes carry. */
extern int (*grad_reader)(PyObject *param);
extern void (*step_writer)(int64_t step);
/* ``tensor``'s dtype (a new reference) and bytes: read in C++ where the timer's reader is set
 * and the tensor a plain torch.Tensor, else its attributes. -1 with no dtype on error (the
 * error set, or cleared where .nbytes was not an int that fits). */
int tensor_now(PyObject *tensor, PyObject **dtype, int64_t *nbytes);

/* The packer (_fast_packer.c). */
extern PyTypeObject PackerType;
/* packer(ring, step, t0, t1, fields) with the times as C integers: 1 once the slot is written,
 * 0 when ``packer`` is not a C packer or no slot was taken (the writer's Python path's). */
int packer_put(PyObject *packer, PyObject *ring, int64_t step, int64_t t0, int64_t t1, PyObject *fields);

/* The collective probe (_fast_collective.c). */
extern PyTypeObject CollectiveType;

/* The backward probe's per-step reads (_fast_step.c): module functions, added at import. */
extern PyMethodDef step_functions[];
int step_init(void);
PyObject *run_queue_now(void);
PyObject *none_grads_of(PyObject *params);
/* The error being raised, normalised, as (type, value, traceback): restored unchanged. */
typedef struct {
    PyObject *type, *value, *tb;
} Raised;
Raised fetch(void);
/* After a call into Python: clear a probe's own error (0), keep a signal handler's (-1). */
int clear_own_error(void);
/* c.pack(kind, t0, t1, c.step, fields), with one more event counted */
void pack_event(State *s, PyObject *kind, int64_t t0, int64_t t1, PyObject *fields);
/* After a recorded backward: drain, run-queue read, its record, the unused check. */
void after_backward(State *s, Progress *saved, int64_t t0, PyObject *helpers);

/* The DDP forward and backward probes (_fast_ddp.c). */
extern PyTypeObject DdpProbeType;
int ddp_init(void);

/* The optimizer probe's step hooks (_fast_opt.c). */
extern PyTypeObject OptProbeType;
int opt_init(void);

/* This thread's Python frames (_fast_frame.c): read in place where this Python's frame layout
 * is declared to extensions (3.11), else through frame objects. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && defined(__has_include) && \
    !defined(DDPDOCTOR_FRAME_OBJECTS)
#if __has_include(<internal/pycore_frame.h>)
#define FAST_FRAMES 1
#endif
#endif
typedef struct {
#if FAST_FRAMES
    struct _PyInterpreterFrame *at;
#else
    PyObject *at; /* the frame object, held */
#endif
    int up; /* frames above the running one */
} Frame;
/* The running frame's ``depth``-th caller (0: the running frame): 0, or -1 when there is none
 * (frame_done still lets it go). */
int frame_caller(Frame *f, int depth);
/* Move to the caller: 0, or -1 when there is none. */
int frame_up(Frame *f);
PyObject *frame_code(const Frame *f); /* borrowed: the running frame holds it */
int frame_lasti(const Frame *f);      /* PyFrame_GetLasti's */
PyFrameObject *frame_object(const Frame *f); /* a new reference, or NULL */
void frame_done(Frame *f);

/* The site callsite.py learnt for the first user frame from ``frame`` up: a new reference,
 * None when not learnt yet, NULL on error. */
PyObject *site_from(const Frame *frame, PyObject *calls, PyObject *is_user);

/* A probe's last site found, with the frames it was found through: the code object of each
 * frame from the first up to the user's (held), that frame's instruction, and the collector
 * whose callsite tables said it (held: they are cleared only when another collector takes
 * them). A call through the same frames to the same instruction has the same site: found by
 * comparing pointers, not by a dict lookup per frame. */
#define SITE_CHAIN 6
typedef struct {
    PyObject *owner, *site;
    PyObject *codes[SITE_CHAIN];
    int n, lasti;
} SiteMemo;
PyObject *site_memo(SiteMemo *m, PyObject *owner, const Frame *frame, PyObject *calls, PyObject *is_user);
void memo_clear(SiteMemo *m);

#endif
