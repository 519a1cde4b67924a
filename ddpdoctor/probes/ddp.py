"""DistributedDataParallel: constructor, forward (with its buffer sync), backward, buckets.

Gradient all-reduces run from C++, so the only place that sees each bucket is a comm hook.
At a model's first forward we register a timing hook whose numerics equal DDP's default
(gradients pre-divided by the world size, then summed); a hook the user registers, before or
after, is timed instead of replaced.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from typing import Any

from ddpdoctor.probes import callsite
from ddpdoctor.probes import collector as _c
from ddpdoctor.probes import cuda_timing as _ct
from ddpdoctor.probes import fingerprint as _fp
from ddpdoctor.probes.collectives import group_info
from ddpdoctor.probes.cpuwait import run_queue_us
from ddpdoctor.probes.patching import patch
from ddpdoctor.trace import schema
from ddpdoctor.trace.livephase import LivePhase

PROBE = "ddp"
_now = time.monotonic_ns
_STATE = "_ddpdoctor_state"  # attribute on each DDP instance
_BROADCAST, _ALLREDUCE = LivePhase.SYNC_BUFFERS.op, LivePhase.BACKWARD.op  # looked up once
_BUCKET = schema.ALLREDUCE


class _ModelState:
    """What we keep per DDP instance: parameter names, the hook being timed, unused checks."""

    def __init__(self, ddp: Any) -> None:
        self.names = {p.data_ptr(): n for n, p in ddp.module.named_parameters()}
        self.param_names, self.params = _reducer_parameters(ddp)
        self.reducer = ddp.reducer
        self.find_unused = bool(ddp.find_unused_parameters)
        self.world = ddp.process_group.size()
        self.group = ddp.process_group
        self.seq_of = _seq_reader(self.group)  # the group's collective sequence number now
        self.user_hook = False
        self.hook: Callable[[Any, Any], Any] | None = None  # the hook our timer calls
        self.hook_state: Any = None
        self.timer_registered = False
        self.builtin_hook = False  # a C++ builtin hook: cannot be timed from Python
        self.layout: dict[int, int] = {}  # bucket index -> bytes, as last recorded
        self.index = 0  # this rank's n-th DistributedDataParallel: what ``unused`` records name


def _seq_reader(group: Any) -> Callable[[], int]:
    try:
        group._get_sequence_number_for_group()
        return group._get_sequence_number_for_group  # type: ignore[no-any-return]
    except Exception:
        return lambda: -1


def install() -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    patch(DDP, "__init__", _wrap_init)
    patch(DDP, "forward", _wrap_forward)
    patch(DDP, "_sync_buffers", _wrap_sync_buffers)
    patch(DDP, "_post_forward", _wrap_post_forward)
    patch(DDP, "register_comm_hook", _wrap_register_comm_hook)
    patch(DDP, "_register_builtin_comm_hook", _wrap_builtin_hook)
    patch(torch.autograd, "backward", _wrap_backward)


def _wrap_init(init: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        c = _c.ACTIVE
        if c is None or PROBE in c.disabled:
            return init(self, *args, **kwargs)
        pg, gname, gsize, seq = group_info(kwargs.get("process_group"), c)
        site = callsite.site(c)
        t0 = _now()
        # The constructor waits for every rank of its group (shape check, state broadcast):
        # a rank blocked here is in a sync point, at the group's sequence number on entry.
        prev = c.enter(LivePhase.DDP_INIT, "init", seq, t0, (gname, gsize, -1, pg))
        try:
            init(self, *args, **kwargs)
        except Exception as exc:
            c.leave(prev, None)
            _model_on_error(c, args[0] if args else kwargs.get("module"), exc)
            raise
        c.leave(prev, None)
        t1 = _now()
        try:
            state = _ModelState(self)
            state.index, c.ddp_models = c.ddp_models, c.ddp_models + 1
            c.pace_model = None  # a model wrapped anew (each epoch, say) may set the pace now
            setattr(self, _STATE, state)
            c.emit(schema.DDP_INIT, t0, t1, {**_describe(self, seq, state), "site": site})
            _ct.start(c, self.module)  # device spans when the model is on CUDA
            _fp.on_ddp_init(c, self, state.index, state.params)
        except Exception as exc:
            c.fail(PROBE, exc)

    return __init__


def _model_on_error(c: _c.Collector, module: Any, exc: BaseException) -> None:
    """The constructor raised (ranks whose models differ): keep this rank's parameter shapes and
    the class of the module owning each, so the ranks' models can be set side by side."""
    try:
        shapes = []
        for owner_name, owner in module.named_modules():
            for name, p in owner.named_parameters(recurse=False):
                full = f"{owner_name}.{name}" if owner_name else name
                shapes.append([full, list(p.shape), type(owner).__name__])
                if len(shapes) >= 1024:
                    break
        info = {"error": "ddp_init", "message": str(exc)[:600], "module": type(module).__name__}
        c.meta(schema.DDP_ERROR, {**info, "shapes": shapes})
    except Exception as err:
        c.fail(PROBE, err)


def _reducer_parameters(ddp: Any) -> tuple[list[str], list[Any]]:
    """Names and tensors in the Reducer's own order (its error messages index into it)."""
    seen: set[int] = set()
    names, params = [], []
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if not param.requires_grad or name in ddp.parameters_to_ignore or id(param) in seen:
                continue
            seen.add(id(param))
            names.append(name)
            params.append(param)
    return names, params


def _describe(ddp: Any, seq: int, state: _ModelState) -> dict[str, Any]:
    params = state.params
    try:
        sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
        buckets = [int(s) for s in sizes.split(",") if s.strip()]
    except Exception:
        buckets = []
    return {
        "module": type(ddp.module).__name__,
        "params": sum(p.numel() for p in params),
        "param_tensors": len(params),
        "param_bytes": sum(p.nbytes for p in params),
        "buckets": buckets,
        "seq": seq,
        "index": state.index,
        "param_names": state.param_names,
        "param_numels": [p.numel() for p in params],
        "options": {
            "find_unused_parameters": bool(ddp.find_unused_parameters),
            "broadcast_buffers": bool(ddp.broadcast_buffers),
            "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
            "static_graph": bool(ddp.static_graph),
            "bucket_cap_mb": ddp.bucket_bytes_cap / 2**20,
            "device_ids": [str(d) for d in (ddp.device_ids or [])],
            "buffers": sum(1 for _ in ddp.module.buffers()),
        },
    }


def _wrap_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    is_grad_enabled = torch.is_grad_enabled

    def forward_(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        c = _c.ACTIVE
        if c is None or PROBE in c.disabled:
            return forward(self, *inputs, **kwargs)
        grad = is_grad_enabled()
        new_step = False
        try:
            state = getattr(self, _STATE, None)
            if grad:
                if c.pace_model is None:
                    c.pace_model = state
                new_step = state is c.pace_model and not c.accumulating
                c.step += new_step
                if state is c.pace_model:  # micro-batches under no_sync() share one optimizer step
                    c.accumulating = not getattr(self, "require_backward_grad_sync", True)
                c.awaiting_backward = True
                c.step_model = state
                if state is not None and not state.timer_registered and not state.builtin_hook:
                    _register_timer(self, state, None, None)
            pg, gname, gsize, seq = group_info(self.process_group, c)
            where = callsite.site(c)
        except Exception as exc:
            c.fail(PROBE, exc)
            return forward(self, *inputs, **kwargs)
        t0 = _now()
        if new_step:
            if c.last_step_ns:
                c.max_step_ns = max(c.max_step_ns, t0 - c.last_step_ns)
            c.last_step_ns = t0
        prev = c.enter(LivePhase.FORWARD, "train" if grad else "eval", seq, t0, (gname, gsize, -1, pg))
        timer = _ct.ACTIVE
        fields = (int(grad), int(self.training), seq, where)
        span = timer.begin(_ct.DEV_FORWARD, c.step, fields) if timer else None
        try:
            result = forward(self, *inputs, **kwargs)
        except BaseException as exc:
            c.raised(prev, schema.FORWARD, *fields)
            if isinstance(exc, RuntimeError) and state is not None and _UNFINISHED_REDUCTION in str(exc):
                _record_ddp_error(c, state, str(exc))
            raise
        finally:
            if span is not None:
                timer.finish(span)  # type: ignore[union-attr]
        c.leave(prev, schema.FORWARD, *fields)
        return result

    return forward_


_UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"
_UNUSED_INDICES = re.compile(r"did not receive grad for rank (\d+): ([\d ,]+)")


def _record_ddp_error(c: _c.Collector, state: _ModelState, message: str) -> None:
    """DDP's unused-parameter error names indices: turn them into parameter names, flush now."""
    try:
        match = _UNUSED_INDICES.search(message)
        indices = [int(i) for i in re.split(r"[ ,]+", match.group(2).strip())] if match else []
        names = [state.param_names[i] for i in indices if 0 <= i < len(state.param_names)]
        c.meta(
            schema.DDP_ERROR, {"error": "unfinished_reduction", "params": names, "message": message[:2000]}
        )
        c.writer.flush()
    except Exception as exc:
        c.fail(PROBE, exc)


def _wrap_post_forward(post: Callable[..., Any]) -> Callable[..., Any]:
    """With find_unused_parameters, DDP walks the autograd graph here: time that walk."""

    def _post_forward(self: Any, output: Any) -> Any:
        c = _c.ACTIVE
        if c is None or not self.find_unused_parameters or PROBE in c.disabled:
            return post(self, output)
        t0 = _now()
        try:
            return post(self, output)
        finally:
            c.emit(schema.GRAPH_SCAN, t0, _now())

    return _post_forward


def check_unused(c: _c.Collector) -> None:
    """After a step's backward: which parameters got no gradient? (Cheap: one pass of flags.)

    Without find_unused_parameters, a parameter whose .grad is still None received none on
    this rank (DDP will raise at the next forward). With it, DDP's used map holds, per
    parameter, on how many ranks it was used; fewer than the world size means unused somewhere.
    """
    state = c.step_model
    if state is None:
        return
    if state.find_unused:
        counts = state.reducer._get_local_used_map()
        short = (counts < state.world).nonzero().flatten().tolist()
        if short:
            used = [int(counts[i]) for i in short]
            info = {"params": short, "used_on_ranks": used, "scope": "global", "model": state.index}
            c.meta(schema.UNUSED, info)
    else:
        missing = [i for i, p in enumerate(state.params) if p.grad is None]
        if missing:
            info = {"params": missing, "used_on_ranks": None, "scope": "local", "model": state.index}
            c.meta(schema.UNUSED, info)


def _wrap_sync_buffers(sync: Callable[..., Any]) -> Callable[..., Any]:
    def _sync_buffers(self: Any, *args: Any, **kwargs: Any) -> Any:
        c = _c.ACTIVE
        if c is None or PROBE in c.disabled:
            return sync(self, *args, **kwargs)
        pg, gname, gsize, seq = group_info(self.process_group, c)
        # The mode tells a hang's diagnosis an evaluation through the wrapper from a training step.
        op = _BROADCAST if getattr(self, "training", True) else f"{_BROADCAST} (eval)"
        prev = c.enter(LivePhase.SYNC_BUFFERS, op, seq, group=(gname, gsize, -1, pg))
        try:
            result = sync(self, *args, **kwargs)
        except BaseException:
            c.raised(prev, schema.SYNC_BUFFERS, seq)
            raise
        c.leave(prev, schema.SYNC_BUFFERS, seq)
        return result

    return _sync_buffers


def _wrap_backward(backward: Callable[..., Any]) -> Callable[..., Any]:
    def backward_(*args: Any, **kwargs: Any) -> Any:
        c = _c.ACTIVE
        if c is None or not c.awaiting_backward or PROBE in c.disabled:
            return backward(*args, **kwargs)
        c.awaiting_backward = False
        prev = c.enter(LivePhase.BACKWARD, _ALLREDUCE, c.progress_seq())
        timer = _ct.ACTIVE
        span = timer.begin(_ct.DEV_BACKWARD, c.step) if timer else None
        try:
            result = backward(*args, **kwargs)
        except BaseException:
            c.raised(prev, schema.BACKWARD, run_queue_us())
            raise
        finally:
            if span is not None:
                timer.finish(span)  # type: ignore[union-attr]
        c.leave(prev, schema.BACKWARD, run_queue_us())
        try:
            check_unused(c)
        except Exception as exc:
            c.fail("unused", exc)
        return result

    return backward_


def _wrap_register_comm_hook(register: Callable[..., Any]) -> Callable[..., Any]:
    def register_comm_hook(self: Any, state: Any, hook: Callable[..., Any]) -> None:
        c = _c.ACTIVE
        model = getattr(self, _STATE, None)
        if c is None or model is None or PROBE in c.disabled:
            return register(self, state, hook)
        if model.user_hook:  # a second registration: let DDP raise its own error
            return register(self, state, hook)
        self._check_comm_hook(hook)  # DDP's own validation of the user's hook
        model.user_hook = True
        if model.timer_registered:
            # Our timer already sits in DDP's single hook slot: time the user's hook inside it.
            model.hook, model.hook_state = hook, state
            c.meta(schema.COMM_HOOK, {"name": _hook_name(hook), "user": True})
            return None
        _register_timer(self, model, hook, state)
        return None

    return register_comm_hook


def _wrap_builtin_hook(register: Callable[..., Any]) -> Callable[..., Any]:
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        model = getattr(self, _STATE, None)
        if model is not None:
            model.builtin_hook = True
        return register(self, comm_hook_type)

    return _register_builtin_comm_hook


def _hook_name(hook: Any) -> str:
    return f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"


def _register_timer(ddp: Any, model: _ModelState, hook: Any, state: Any) -> None:
    """Put our timing hook in DDP's comm hook slot, around ``hook`` (DDP's default if None)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpdoctor.probes.patching import original

    c = _c.ACTIVE
    if getattr(ddp, "_comm_hooks", None):  # registered before we were watching: leave it be
        model.builtin_hook = True
        if c is not None:
            c.meta(schema.COMM_HOOK, {"name": "unknown (registered before ddpdoctor)", "timed": False})
        return
    model.hook, model.hook_state = (hook, state) if hook is not None else (_default_hook, ddp)
    model.timer_registered = True
    original(DDP.register_comm_hook)(ddp, model, _timing_hook)
    if c is not None:
        name = _hook_name(hook) if hook is not None else "ddp default (allreduce average)"
        c.meta(schema.COMM_HOOK, {"name": name, "user": hook is not None})


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
