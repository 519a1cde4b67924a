/* This thread's Python frames as the probes read them for a call site: each frame's code object
 * and instruction, and the frame objects only where Python code needs one.
 *
 * Asking for a frame object makes one for every frame it passes that has none, and a frame of a
 * call that is still running has none: the probe's own wrapper, torch's Module._call_impl. Each
 * is allocated, tracked by the collector and freed again as its function returns, about 500
 * instructions per frame on every recorded event, in code and memory the caches lost while the
 * call blocked (docs/overhead.md, twenty-first round). Where the interpreter's frame layout is
 * known (CPython 3.11, whose headers declare it) the frames are read in place and none is made;
 * elsewhere through frame objects, as before.
 */
#include "_fast.h"

#if FAST_FRAMES
#include <internal/pycore_frame.h>

int frame_caller(Frame *f, int depth) {
    f->at = PyThreadState_Get()->cframe->current_frame; /* PyEval_GetFrame's frame */
    f->up = 0;
    for (int i = 0; i < depth && f->at; i++) frame_up(f);
    return f->at ? 0 : -1;
}

int frame_up(Frame *f) { /* PyFrame_GetBack's: a frame not yet running its code is skipped */
    struct _PyInterpreterFrame *back = f->at->previous;
    while (back && _PyFrame_IsIncomplete(back)) back = back->previous;
    f->at = back;
    f->up++;
    return back ? 0 : -1;
}

PyObject *frame_code(const Frame *f) { return (PyObject *)f->at->f_code; }

int frame_lasti(const Frame *f) { /* PyFrame_GetLasti's */
    int lasti = _PyInterpreterFrame_LASTI(f->at);
    return lasti < 0 ? -1 : lasti * (int)sizeof(_Py_CODEUNIT);
}

PyFrameObject *frame_object(const Frame *f) {
    PyFrameObject *o = PyEval_GetFrame();
    Py_XINCREF(o);
    for (int i = 0; i < f->up && o; i++) Py_SETREF(o, PyFrame_GetBack(o));
    return o;
}

void frame_done(Frame *f) { f->at = NULL; }

static void frame_copy(Frame *to, const Frame *from) { *to = *from; }

#else

int frame_caller(Frame *f, int depth) {
    f->at = (PyObject *)PyEval_GetFrame();
    Py_XINCREF(f->at);
    f->up = 0;
    for (int i = 0; i < depth && f->at; i++) frame_up(f);
    return f->at ? 0 : -1;
}

int frame_up(Frame *f) {
    Py_SETREF(f->at, (PyObject *)PyFrame_GetBack((PyFrameObject *)f->at));
    f->up++;
    return f->at ? 0 : -1;
}

PyObject *frame_code(const Frame *f) { /* borrowed: the running frame holds it */
    PyCodeObject *code = PyFrame_GetCode((PyFrameObject *)f->at);
    Py_DECREF(code);
    return (PyObject *)code;
}

int frame_lasti(const Frame *f) { return PyFrame_GetLasti((PyFrameObject *)f->at); }

PyFrameObject *frame_object(const Frame *f) { return (PyFrameObject *)Py_XNewRef(f->at); }

void frame_done(Frame *f) { Py_CLEAR(f->at); }

static void frame_copy(Frame *to, const Frame *from) {
    *to = *from;
    Py_XINCREF(to->at);
}

#endif

/* site_from, and the frames it walked when it found a site: their code objects (borrowed; at
 * most SITE_CHAIN) in ``codes``, their number in *n (0 when it found none or walked more), the
 * user frame's instruction in *lasti. */
static PyObject *site_walk(const Frame *start, PyObject *calls, PyObject *is_user, PyObject **codes, int *n,
                           int *lasti) {
    PyObject *found = Py_None;
    Frame frame;
    frame_copy(&frame, start);
    *n = 0;
    for (int hop = 0; frame.at && hop < 64; hop++) {
        /* is_user[id(code)] = (is it the user's, code); calls[(id(code), instruction)] = site,
         * for user frames only */
        PyObject *code = frame_code(&frame); /* a live frame's: alive while it runs */
        PyObject *code_id = PyLong_FromVoidPtr(code);
        if (hop < SITE_CHAIN) codes[hop] = code;
        PyObject *mine = code_id ? PyDict_GetItemWithError(is_user, code_id) : NULL;
        int user = mine && PyTuple_Check(mine) && PyTuple_GET_SIZE(mine) >= 1 ? PyObject_IsTrue(PyTuple_GET_ITEM(mine, 0)) : -1;
        if (user == 0) { /* a library's frame: its caller's */
            Py_DECREF(code_id);
            frame_up(&frame);
            continue;
        }
        if (user == 1) { /* the user's frame: its site, if this instruction's is known */
            int at = frame_lasti(&frame);
            PyObject *key = Py_BuildValue("(Oi)", code_id, at);
            PyObject *sid = key ? PyDict_GetItemWithError(calls, key) : NULL;
            Py_XDECREF(key);
            if (sid != NULL) {
                found = sid;
                *n = hop < SITE_CHAIN ? hop + 1 : 0;
                *lasti = at;
            }
        }
        Py_XDECREF(code_id);
        break; /* a frame not seen yet, or an instruction not learnt yet: the Python walk's */
    }
    frame_done(&frame);
    if (PyErr_Occurred()) return NULL;
    return Py_NewRef(found);
}

PyObject *site_from(const Frame *frame, PyObject *calls, PyObject *is_user) {
    PyObject *codes[SITE_CHAIN];
    int n, lasti;
    return site_walk(frame, calls, is_user, codes, &n, &lasti);
}

void memo_clear(SiteMemo *m) {
    Py_CLEAR(m->owner);
    Py_CLEAR(m->site);
    for (int i = 0; i < m->n; i++) Py_CLEAR(m->codes[i]);
    m->n = 0;
}

PyObject *site_memo(SiteMemo *m, PyObject *owner, const Frame *frame, PyObject *calls, PyObject *is_user) {
    if (m->n > 0 && m->owner == owner) {
        int hit = 0;
        Frame f;
        frame_copy(&f, frame);
        for (int i = 0; f.at != NULL && i < m->n; i++) {
            if (frame_code(&f) != m->codes[i]) break; /* compared by address only */
            if (i == m->n - 1) {
                hit = frame_lasti(&f) == m->lasti;
                break;
            }
            frame_up(&f);
        }
        frame_done(&f);
        if (hit) return Py_NewRef(m->site);
    }
    PyObject *codes[SITE_CHAIN];
    int n, lasti;
    PyObject *found = site_walk(frame, calls, is_user, codes, &n, &lasti);
    if (found != NULL && found != Py_None && n > 0) {
        memo_clear(m);
        for (int i = 0; i < n; i++) m->codes[i] = Py_NewRef(codes[i]);
        m->n = n;
        m->lasti = lasti;
        m->owner = Py_NewRef(owner);
        m->site = Py_NewRef(found);
    }
    return found;
}
