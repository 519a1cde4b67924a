/* The collective probe's object, shared by _fast_collective.c (its hot path) and
 * _fast_collective_rare.c (what a call seen before does not need: a new call site, a
 * raise, a broken probe, the arguments that name a group or a root). */
#ifndef DDPDOCTOR_FAST_COLLECTIVE_H
#define DDPDOCTOR_FAST_COLLECTIVE_H

#include "_fast.h"

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
    /* image_of's record as far as the call site says it (op, bytes, group, group size, site,
     * signature), stored once: a call copies it and stores its own fields over it. image_bad:
     * one does not fit its type (every record of the site is lost, counted) */
    PyObject *image_of;
    _Alignas(8) char image[RING_SLOT];
    int image_bad;
    long long image_sid, image_site; /* its signature and site ids, for enter_call */
    int ids_bad;                     /* one is not an int of 64 bits */
    PyObject *kid_c; /* the collector whose collective kind id this is */
    long long kid;
    PyObject *compiler; /* torch.compiler's module dict: its _is_compiling_flag */
    Global active, compiling; /* collector.ACTIVE, torch.compiler._is_compiling_flag */
} Collective;

int coll_is_group(PyObject *obj);
long long coll_root_of(Collective *self, PyObject *args, PyObject *kwargs);
COLD int coll_kid_find(Collective *self, State *s);
int coll_image_from(const Layout *layout, PyObject *known, char *image, long long *sid, long long *site,
                    int *ids_bad);
COLD PyObject *coll_broke(Collective *self, PyObject *c, PyObject *args, PyObject *kwargs);
COLD PyObject *coll_learn_call(Collective *self, PyObject *c, PyObject *calls, PyObject *code, int lasti,
                               PyObject *group, int async_, long long root, PyObject *dtype, int64_t nb);
COLD void coll_raised(Collective *self, PyObject *c, State *s, Progress *saved, PyObject *known,
                      PyObject *seq_obj, PyObject *site_obj, int async_);

#endif
