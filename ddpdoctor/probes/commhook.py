"""DDP's comm hook slot: the one place that sees each gradient bucket's all-reduce (they run
from C++). At a model's first forward (``ddp.py``) a timing hook is registered whose numerics
equal DDP's default (gradients pre-divided by the world size, then summed); a hook the user
registers, before or after, is timed instead of replaced.

Any hook written in Python costs a GIL trip per bucket and one for its completion: about what
torch's own Python ``allreduce_hook`` costs, 25-130 µs a bucket on a 2-core host
(``benchmarks/hook_cost.py``), several per cent of a millisecond step. So where the C++ timer
is built (``native.py``) and the model is on the CPU, it takes DDP's slot instead, and this
module only packs its notes (``drain``, off the training thread once the buckets are laid out).

``DDPDOCTOR_BUCKET_TIMING``: ``auto`` (the default) registers the C++ timer at once on
gradients a cache holds (``FREE_PASS_BYTES``); otherwise it lets the first steps run on DDP's
C++ reduction and registers a timer only if their median step can carry its cost
(``affordable``): the Python timer's per bucket, or the C++ timer's pass over the gradients.
Any comm hook costs that pass: DDP divides each gradient as it copies it into its bucket when
its slot is empty, and leaves the division to the hook otherwise (3-8 % of a 50 ms step of a
10M-parameter MLP on this project's CPU, docs/overhead.md), which is why ``on``, which
registers the timer at the model's first forward whatever it costs, is not the default.
``off`` never times: DDP's C++ reduction (or the user's hook) alone. Untimed, the
gradient all-reduces keep their sequence numbers (the gaps between the recorded ones,
``analysis/failed/ledger.py``) and the straggler table measures each rank's time in backward
(``analysis/slow/synctable.py``); each bucket's own span is lost (docs/overhead.md).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from ddpdoctor import _env
from ddpdoctor.probes import collector as _c
from ddpdoctor.probes import cuda_timing as _ct
from ddpdoctor.probes import guard, native
from ddpdoctor.probes.ddp_model import ModelState, state_of
from ddpdoctor.trace import schema
from ddpdoctor.trace.notes import NOTE, notes_path

PROBE = "comm_hook"
NATIVE = "comm_hook_native"  # the C++ timer (native.py), switched off on its own
_now = time.monotonic_ns
_BUCKET = schema.ALLREDUCE
HOOK_COST_S = 100e-6  # what timing costs a step, per bucket (benchmarks/hook_cost.py, overhead.py: 25-130 µs)
STEP_SHARE = 0.005  # of the median step: the most bucket timing may cost it (issue 25: big jobs 1.005x)
DECIDE_AFTER = 3  # step intervals measured before deciding (not the first step: DDP rebuilds buckets)
# Gradients up to this many bytes: the C++ timer goes in at once under ``auto``. Its pass over
# them runs in cache, and a hook's copy into the bucket is cheaper than DDP's dividing copy: the
# step got 27-200 µs shorter with a C++ hook at 0.24-1 MB, and 0.3-3 ms longer at 4-40 MB
# (docs/overhead.md, eleventh round).
FREE_PASS_BYTES = 1 << 20
PASS_PROBE_BYTES = 64 << 20  # the most a pass is timed on (scaled linearly beyond)


def mode() -> str:
    """``DDPDOCTOR_BUCKET_TIMING``: ``ddpdoctor run`` refuses a bad value; a rank started some
    other way takes the default."""
    try:
        return _env.bucket_timing()
    except ValueError:
        return _env.BUCKET_TIMING_MODES[0]


def affordable(step_s: float, buckets: int) -> bool:
    """Can a step of ``step_s`` seconds carry the timing of ``buckets`` buckets?"""
    return max(buckets, 1) * HOOK_COST_S <= STEP_SHARE * step_s


def at_forward(ddp: Any, model: ModelState, c: _c.Collector) -> None:
    """A training forward of a model whose buckets are neither timed nor left untimed yet:
    the timer goes in now (``on``), never (``off``), or once the steps say it is cheap."""
    if not model.timing:
        model.timing = mode()
    cpp = _ct.ACTIVE is None and native.eligible(ddp)
    if model.timing != "auto" or (cpp and grad_bytes(model) <= FREE_PASS_BYTES):
        register_timer(ddp, model, None, None)  # "on", or the C++ timer on cached gradients
        return
    if c.step == model.last_step_seen:
        return
    model.last_step_seen = c.step
    model.step_marks.append(_now())
    if len(model.step_marks) < DECIDE_AFTER + 2:
        return
    marks = model.step_marks[1:]
    step_s = statistics.median(b - a for a, b in zip(marks, marks[1:])) / 1e9
    buckets = bucket_count(ddp)
    info: dict[str, Any] = {"step_ms": round(step_s * 1e3, 3), "buckets": buckets}
    if cpp:  # the C++ timer's cost: one more pass over the gradients, timed here
        try:
            pass_s: float | None = pass_cost_s(model)
        except Exception as exc:  # no room for the scratch tensor: a pass too dear to take
            guard.passthrough(exc)
            pass_s = None
        info.update(grad_mb=round(grad_bytes(model) / 2**20, 2))
        info["pass_us"] = round(pass_s * 1e6, 1) if pass_s is not None else None
        timed = pass_s is not None and pass_s <= STEP_SHARE * step_s
    else:
        info["cost_us"] = HOOK_COST_S * 1e6
        timed = affordable(step_s, buckets)
    info.update(share=STEP_SHARE)
    model.step_marks.clear()
    if timed:
        register_timer(ddp, model, None, None, decided=info)
    else:
        model.untimed = True
        name = "ddp default (allreduce average)"
        c.meta(schema.COMM_HOOK, {"name": name, "user": False, "timed": False, "auto": info})
        record_layout(ddp, model, c)


def grad_bytes(model: ModelState) -> int:
    """Bytes of the gradients DDP reduces: what a comm hook passes over once more."""
    return sum(p.numel() * p.element_size() for p in model.params)


def pass_cost_s(model: ModelState) -> float:
    """Seconds one more pass over the model's gradients takes here (the C++ timer scales each
    bucket by 1/world size as DDP's own reduction does, after the copy DDP then makes plain):
    the best of three scalings of a warm scratch tensor of their size, at most
    ``PASS_PROBE_BYTES`` (scaled linearly beyond). Once per model, at its decision (a model
    with parameters: one without has nothing to pass over and is timed at once)."""
    import torch

    nbytes, first = grad_bytes(model), model.params[0]
    item = first.element_size()
    scratch = torch.zeros(max(1, min(nbytes, PASS_PROBE_BYTES) // item), dtype=first.dtype)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        scratch.mul_(1.0)
        best = min(best, time.perf_counter() - t0)
    return best * nbytes / (len(scratch) * item)


def record_layout(ddp: Any, model: ModelState, c: _c.Collector) -> None:
    """The buckets as DDP rebuilt them after the first step, which parameters in which (what
    the timing hook records as it sees each bucket), from DDP's own logging data."""
    try:
        data = ddp._get_ddp_logging_data()
        sizes = [int(x) for x in str(data.get("rebuilt_bucket_sizes", "")).split(",") if x.strip()]
        indices = str(data.get("rebuilt_per_bucket_param_indices", "")).split(",")
        if not sizes or len(indices) != len(sizes):
            return
        names = model.param_names
        for index, (nbytes, members) in enumerate(zip(sizes, indices, strict=True)):
            params = [names[int(i)] if 0 <= int(i) < len(names) else "?" for i in members.split()]
            model.layout[index] = nbytes
            c.meta(schema.BUCKET, {"index": index, "bytes": nbytes, "params": params})
    except Exception as exc:
        guard.passthrough(exc)


def bucket_count(ddp: Any) -> int:
    """How many gradient buckets DDP reduced in its last step (its count after the rebuild at
    the first step, where it says no more); 1 if it does not say."""
    try:
        data = ddp._get_ddp_logging_data()
        if int(data.get("num_buckets_reduced", 0)) > 0:
            return int(data["num_buckets_reduced"])
        sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
        return max(1, sum(1 for s in sizes.split(",") if s.strip()))
    except Exception as exc:
        guard.passthrough(exc)
        return 1


def install() -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpdoctor.probes.patching import patch

    patch(DDP, "register_comm_hook", _wrap_register_comm_hook)
    patch(DDP, "_register_builtin_comm_hook", _wrap_builtin_hook)


def _wrap_register_comm_hook(register: Callable[..., Any]) -> Callable[..., Any]:
    def register_comm_hook(self: Any, state: Any, hook: Callable[..., Any]) -> None:
        c = _c.ACTIVE
        model = state_of(self)
        if c is None or model is None or PROBE in c.disabled:
            return register(self, state, hook)
        if model.user_hook:  # a second registration: let DDP raise its own error
            return register(self, state, hook)
        self._check_comm_hook(hook)  # DDP's own validation of the user's hook
        model.user_hook = True
        if model.timer_registered:
            # Our timer already sits in DDP's single hook slot: time the user's hook inside it.
            model.hook, model.hook_state = hook, state
            if model.native is not None:  # the C++ timer runs it, through our Python timer
                model.native.set_python_hook(model, _timing_hook)
            c.meta(schema.COMM_HOOK, {"name": _hook_name(hook), "user": True})
            return None
        register_timer(self, model, hook, state)
        return None

    return register_comm_hook


def _wrap_builtin_hook(register: Callable[..., Any]) -> Callable[..., Any]:
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        model = state_of(self)
        if model is not None:
            model.untimed = True
        return register(self, comm_hook_type)

    return _register_builtin_comm_hook


def _hook_name(hook: Any) -> str:
    return f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"


def register_timer(ddp: Any, model: ModelState, hook: Any, state: Any, decided: dict | None = None) -> None:
    """Put our timing hook in DDP's comm hook slot, around ``hook`` (DDP's default if None);
    ``decided``: what the automatic choice measured (``at_forward``), for the record."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpdoctor.probes.patching import original

    c = _c.ACTIVE
    if getattr(ddp, "_comm_hooks", None):  # registered before we were watching: leave it be
        model.untimed = True
        if c is not None:
            c.meta(schema.COMM_HOOK, {"name": "unknown (registered before ddpdoctor)", "timed": False})
        return
    info = {"name": _hook_name(hook) if hook is not None else "ddp default (allreduce average)"}
    info["user"] = hook is not None
    if decided is not None:
        info["auto"] = decided
    if mode() == "off":  # DDP's own reduction, not a Python hook
        model.untimed = True
        info["timed"] = False
        if hook is not None:
            original(DDP.register_comm_hook)(ddp, state, hook)
    else:
        model.hook, model.hook_state = (hook, state) if hook is not None else (_default_hook, ddp)
        model.timer_registered = True
        model.native = _native_timer(ddp, c) if hook is None and c is not None else None
        if model.native is not None:
            info["native"] = True
            c.native.append(model)  # type: ignore[union-attr]
        else:
            original(DDP.register_comm_hook)(ddp, model, _timing_hook)
    if c is not None:
        c.meta(schema.COMM_HOOK, info)


def _native_timer(ddp: Any, c: _c.Collector) -> Any:
    """The C++ timer in DDP's slot (``native.py``), or None: the Python hook times the buckets."""
    if _ct.ACTIVE is not None:  # a GPU model's buckets are timed on the device too, in Python
        return None
    try:
        ring = c.writer.ring
        handle = native.register(ddp, notes_path(ring.path) if ring is not None and ring.path else "")
    except Exception as exc:
        c.fail(NATIVE, exc)
        return None
    if handle is not None:
        c.native_step = native.module().set_step
        c.native_step(c.step)
        c.native_settling, c.native_quiet = True, 0
    return handle


# Backwards in a row whose drain found no new bucket layout before the training thread stops
# draining: DDP lays out its buckets at step 0's backward and again after its rebuild (step 1).
_SETTLED_AFTER = 2
# A drain's take, pack and commit, one at a time: a commit says every note up to it is packed.
_draining = threading.Lock()


def drain(c: _c.Collector) -> int:
    """Pack the C++ timer's notes into the trace (each bucket's all-reduce, then commit them:
    ``trace/notes.py``) and the layout of each bucket seen with a new size, as ``_timing_hook``
    records them; the number of layouts. From the writer thread four times a second (a hang's
    completed buckets reach the trace too) and at the collector's close; each record is packed
    under the GIL, as the device timer's."""
    if NATIVE in c.disabled or not _draining.acquire(blocking=False):
        return 0  # a drain under way (another thread's, or the one a signal handler interrupted)
    laid = 0
    try:
        for model in c.native:
            for index, nbytes, ptrs in model.native.drain() or ():
                laid += 1
                model.layout[index] = nbytes
                names = [model.names.get(p, "?") for p in ptrs]
                c.meta(schema.BUCKET, {"index": index, "bytes": nbytes, "params": names})
        if c.native:
            notes, taken, lost = native.module().drain_notes()
            if notes:
                c.events += len(notes) // NOTE.size
                _pack_notes(c, notes)
            native.module().commit_notes(taken)
            c.writer.dropped += lost  # reported with the ring's own (a full buffer)
    except Exception as exc:
        c.fail(NATIVE, exc)
    finally:
        _draining.release()
    return laid


def drain_settling(c: _c.Collector) -> None:
    """After each backward while DDP may still lay out buckets: their layouts reach the trace
    before the next step, as the Python timer's do. Then the training thread leaves the notes,
    which a death does not take (``trace/notes.py``), to the writer thread."""
    c.native_quiet = 0 if drain(c) else c.native_quiet + 1
    if c.native_quiet >= _SETTLED_AFTER:
        c.native_settling = False


def _pack_notes(c: _c.Collector, notes: bytes) -> None:
    """The notes as bucket all-reduce records: by the C packer in one call where it runs, else
    (and for the rows it could take no slot for) one by one by the writer's pack."""
    kind, ring = c.bucket_kind, c.writer.ring
    if ring is None:
        return
    rest = kind.fast.many(ring, notes) if kind.fast is not None else 0
    if rest is not None:
        for step, t0, t1, *fields in NOTE.iter_unpack(notes[rest * NOTE.size :]):
            c.pack(kind, t0, t1, step, tuple(fields))


def _default_hook(ddp: Any, bucket: Any) -> Any:
    """DDP's built-in reduction, bit for bit: scale by 1/world size, then all-reduce SUM."""
    return _default_allreduce(ddp, bucket.buffer()).get_future().then(_first_value)


_SUM_ASYNC: list[Any] = []  # the AllreduceOptions of DDP's reduction, made once


def _default_allreduce(ddp: Any, tensor: Any) -> Any:
    """The default hook's work handle, for the timing hook to finish in its own callback.

    The process group's own ``allreduce`` with c10d's options for ``all_reduce(tensor,
    async_op=True)``: what ``dist.all_reduce`` would call after its checks, none of which a
    gradient bucket can fail, and which cost a few microseconds per bucket."""
    group = ddp.process_group
    tensor.mul_(1.0 / group.size())  # exactly what the Reducer does (mul by 1/world, not div)
    if tensor.is_complex():
        import torch

        tensor = torch.view_as_real(tensor)
    if not _SUM_ASYNC:
        from torch.distributed import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        opts.asyncOp = True
        _SUM_ASYNC.append(opts)
    return group.allreduce([tensor], _SUM_ASYNC[0])


def _first_value(fut: Any) -> Any:
    return fut.value()[0]


def _timing_hook(model, bucket):  # type: ignore[no-untyped-def]  # DDP rejects foreign annotations
    """The hook DDP calls per bucket: time the wrapped hook from bucket-ready to reduced."""
    c = _c.ACTIVE
    inner, inner_state = model.hook, model.hook_state
    assert inner is not None
    if c is None or PROBE in c.disabled:
        return inner(inner_state, bucket)
    try:
        t0 = _now()
        index = bucket.index()
        buffer = bucket.buffer()
        nbytes = buffer.nbytes
        seq = model.seq_of()
        timer = _ct.ACTIVE  # gradients are ready on the compute stream now
        span = timer.begin(_ct.DEV_ALLREDUCE, c.step, (index, nbytes, seq)) if timer else None
        if model.layout.get(index) != nbytes:
            model.layout[index] = nbytes
            names = [model.names.get(p.data_ptr(), "?") for p in bucket.parameters()]
            c.meta(schema.BUCKET, {"index": index, "bytes": nbytes, "params": names})
    except Exception as exc:
        c.fail(PROBE, exc)
        return inner(inner_state, bucket)
    c.in_bucket_hook = True  # a user hook's own dist.all_reduce is part of this bucket event
    try:
        if inner is _default_hook:  # one Python callback per bucket, not two: each costs a GIL trip
            fut = _default_allreduce(inner_state, buffer).get_future()
        else:
            fut = inner(inner_state, bucket)
    finally:
        c.in_bucket_hook = False
    unwrap = inner is _default_hook

    def reduced(done: Any) -> Any:
        value = done.value()
        if span is not None:  # the current stream here waits for the collective
            timer.finish(span)  # type: ignore[union-attr]
        with contextlib.suppress(Exception):
            c.emit(_BUCKET, t0, _now(), index, nbytes, seq)
        return value[0] if unwrap else value

    try:
        return fut.then(reduced)
    except Exception as exc:
        c.fail(PROBE, exc)
        return fut
