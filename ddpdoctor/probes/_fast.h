/* Declarations shared by the probes' C hot paths: _fast.c (the module, the ring, the packer,
 * site()), _fast_packer.c (the packer), _fast_collective.c (the collective probe), _fast_step.c
 * (the backward probe's per-step work), _fast_ddp.c (the DDP forward and backward probes) and
 * _fast_opt.c (the optimizer's step hooks). */
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

#define MAX_FIELDS 32
#define RING_HEADER 64 /* trace/ring.py's HEADER_BYTES, SLOT and VOID, checked against it at import */
#define RING_SLOT 128
#define RING_VOID 0xFFFF /* the kind id of a slot that holds no event */
#define RING_CALL_AT 32  /* the collective entered last: i64 seq, i32 signature id, i32 site id */

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
extern PyObject *s_active, *s_in_bucket_hook, *s_disabled, *s_progress, *s_calls, *s_step, *s_events,
    *s_writer, *s_ring, *s_mm, *s_mask, *s_next, *s_head, *s_dtype, *s_nbytes, *s_group, *s_async_op,
    *s_collectives, *s_raised, *s_lost, *s_collective_kind, *s_seq_method, *one;


/* Shared by the module's parts (_fast.c). */
int64_t now_ns(void);
int parse_format(Layout *self, const char *fmt);
int64_t as_i64(PyObject *v, int *bad);
void ring_clear(RingRef *r);
int ring_set(RingRef *r, PyObject *ring);
PyObject *take_slot(RingRef *r, Py_ssize_t *at);
void write_slot(RingRef *r, const Layout *layout, const Value *values, int bad, PyObject *n_obj, Py_ssize_t at);
Value as_value(PyObject *v, char code, int *bad);
void head_to(RingRef *r, PyObject *n_obj);
void enter_call(RingRef *r, PyObject *seq, PyObject *sid, PyObject *site);

int store(char *base, char code, int offset, Value value);
PyObject *seq_now(PyObject *group, PyObject *seq_of);

/* The packer (_fast_packer.c). */
extern PyTypeObject PackerType;

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
/* c.pack(kind, t0, t1, step, fields), ``d`` the collector's dict, ``kind_attr`` its kind's name */
void pack_event(PyObject *d, PyObject *kind_attr, int64_t t0, int64_t t1, PyObject *fields);
/* After a recorded backward: drain, run-queue read, its record, the unused check. */
void after_backward(PyObject *c, PyObject *d, PyObject *prev, int64_t t0, PyObject *helpers, PyObject *kind_attr);

/* The DDP forward and backward probes (_fast_ddp.c). */
extern PyTypeObject DdpProbeType;
int ddp_init(void);

/* The optimizer probe's step hooks (_fast_opt.c). */
extern PyTypeObject OptProbeType;
int opt_init(void);

/* The site callsite.py learnt for the first user frame from ``frame`` up: a new reference,
 * None when not learnt yet, NULL on error (_fast.c). */
PyObject *site_from(PyFrameObject *frame, PyObject *calls, PyObject *is_user);

#endif
