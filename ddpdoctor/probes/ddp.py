"""DistributedDataParallel: constructor, forward (with its buffer sync), backward; at a
model's first forward, the comm hook that times its buckets (``commhook.py``)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from ddpdoctor.probes import callsite, commhook, ddp_model, fastpath, guard
from ddpdoctor.probes import collector as _c
from ddpdoctor.probes import cuda_timing as _ct
from ddpdoctor.probes import fingerprint as _fp
from ddpdoctor.probes.collectives import group_info
from ddpdoctor.probes.cpuwait import run_queue_us
from ddpdoctor.probes.data import count_inputs
from ddpdoctor.probes.ddp_model import STATE, ModelState, state_of
from ddpdoctor.probes.patching import patch
from ddpdoctor.trace import schema
from ddpdoctor.trace.livephase import LivePhase

PROBE = "ddp"
_now = time.monotonic_ns
_BROADCAST, _ALLREDUCE = LivePhase.SYNC_BUFFERS.op, LivePhase.BACKWARD.op  # looked up once
IN_C: dict[str, Any] = {}  # "forward"/"backward" -> the C probe, where it runs (its ``recorded``)
_FORWARD, _BACKWARD, _TRAIN, _EVAL = LivePhase.FORWARD, LivePhase.BACKWARD, "train", "eval"


def install() -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    patch(DDP, "__init__", _wrap_init)
    patch(DDP, "forward", _wrap_forward)
    patch(DDP, "_sync_buffers", _wrap_sync_buffers)
    patch(DDP, "_post_forward", _wrap_post_forward)
    commhook.install()
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
        except BaseException as exc:
            c.raised(prev, schema.DDP_INIT, {"seq": seq, "site": site})
            if isinstance(exc, Exception):
                _model_on_error(c, args[0] if args else kwargs.get("module"), exc)
            raise
        c.leave(prev, None)
        t1 = _now()
        try:
            state = ModelState(self)
            state.index, c.ddp_models = c.ddp_models, c.ddp_models + 1
            c.pace_model = None  # a model wrapped anew (each epoch, say) may set the pace now
            setattr(self, STATE, state)
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


def _describe(ddp: Any, seq: int, state: ModelState) -> dict[str, Any]:
    params = state.params
    try:
        sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
        buckets = [int(s) for s in sizes.split(",") if s.strip()]
    except Exception as exc:
        guard.passthrough(exc)
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
            # its name from torch 2.13 on (broadcast_buffers is the deprecated alias): the user's word
            **(
                {"forward_sync_buffers": bool(ddp.forward_sync_buffers)}
                if hasattr(ddp, "forward_sync_buffers")
                else {}
            ),
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
            state = state_of(self)
            if grad:
                if c.pace_model is None:
                    c.pace_model = state
                new_step = state is c.pace_model and not c.accumulating
                c.step += new_step
                if new_step and c.native_step is not None:
                    c.native_step(c.step)
                if state is c.pace_model:  # micro-batches under no_sync() share one optimizer step
                    c.accumulating = not getattr(self, "require_backward_grad_sync", True)
                c.awaiting_backward = True
                c.step_model = state
                if state is not None and not state.timer_registered and not state.untimed:
                    commhook.at_forward(self, state, c)
                if new_step and c.step >= c.inputs_at:  # a sampled step: what its inputs hold
                    count_inputs(c, inputs, kwargs)
            if state is not None:  # the model's group: looked up once, its number read now
                if state.group_named is None:
                    state.group_named = group_info(state.group, c)[:3]
                pg, gname, gsize = state.group_named
                seq = state.seq_of()
            else:
                pg, gname, gsize, seq = group_info(self.process_group, c)
            where = callsite.site(c)
            before = None
            if state is not None and not state.forward_seen:
                state.forward_seen = True
                before = ddp_model.versions(state)
        except Exception as exc:
            c.fail(PROBE, exc)
            return forward(self, *inputs, **kwargs)
        t0 = _now()
        if new_step:
            if c.last_step_ns:
                c.max_step_ns = max(c.max_step_ns, t0 - c.last_step_ns)
            c.last_step_ns = t0
        prev = c.progress  # c.enter and c.leave, inlined: once per forward
        c.progress = (_FORWARD, _TRAIN if grad else _EVAL, seq, t0, gname, gsize, -1, pg)
        timer = _ct.ACTIVE
        fields = (int(grad), int(self.training), seq, where)
        span = timer.begin(_ct.DEV_FORWARD, c.step, fields) if timer else None
        try:
            result = forward(self, *inputs, **kwargs)
        except BaseException as exc:
            _forward_raised(c, prev, state, fields, exc)
            raise
        finally:
            if span is not None:
                timer.finish(span)  # type: ignore[union-attr]
        t1 = _now()
        c.progress = prev
        c.events += 1
        c.pack(c.forward_kind, t0, t1, c.step, fields)
        if before is not None:
            try:
                ddp_model.changed_in_forward(c, state, self, before)
            except Exception as exc:
                c.fail(PROBE, exc)
        return result

    probe = _in_c(False, forward, forward_, _forward_raised, (), LivePhase.FORWARD, _TRAIN, _EVAL)
    if probe is None:
        return forward_

    def forward_c(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        return probe(self, inputs, kwargs)

    return forward_c


def _forward_raised(
    c: _c.Collector, prev: Any, state: ModelState | None, fields: tuple, exc: BaseException
) -> None:
    """A DDP forward raised: its ``raised`` record, and the unused parameters DDP's error names."""
    c.raised(prev, schema.FORWARD, *fields)
    if isinstance(exc, RuntimeError) and state is not None and _UNFINISHED_REDUCTION in str(exc):
        _record_ddp_error(c, state, str(exc))


def _in_c(
    backward: bool,
    orig: Callable[..., Any],
    slow: Callable[..., Any],
    raised: Callable[..., Any],
    helpers: tuple,
    phase: LivePhase,
    op: str,
    op_eval: str,
) -> Any:
    """The C module's probe for the steady state (``_fast_ddp.c``; ``slow`` for everything
    else), or None where the Python path runs alone."""
    fast = fastpath.module()
    if fast is None:
        return None
    try:
        IN_C["backward" if backward else "forward"] = probe = fast.DdpProbe(
            backward=backward,
            orig=orig,
            slow=slow,
            failed=_broke,
            raised=raised,
            helpers=helpers,
            globals=vars(_c),
            cuda_globals=vars(_ct),
            site_globals=vars(callsite),
            grad_enabled=_grad_enabled(),
            phase=phase,
            op=op,
            op_eval=op_eval,
            state_attr=STATE,
            depth=1,  # the user's frame is the Python wrapper's caller
        )
        return probe
    except Exception as exc:  # a C module from another version of this file
        guard.passthrough(exc)
        return None


def _grad_enabled() -> Callable[[], bool]:
    import torch

    return torch.is_grad_enabled


def _broke(c: _c.Collector, exc: BaseException) -> None:
    """The C path's ``except Exception`` before the call: log it, switch the probe off."""
    c.fail(PROBE, exc)


_UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"
_UNUSED_INDICES = re.compile(r"did not receive grad for rank (\d+): ([\d ,]+)")


def _record_ddp_error(c: _c.Collector, state: ModelState, message: str) -> None:
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
        note_unused(c, state, _none_grads(state.params))


def note_unused(c: _c.Collector, state: ModelState, missing: list[int]) -> None:
    """The parameters whose .grad is still None after this rank's backward (indices)."""
    if missing:
        info = {"params": missing, "used_on_ranks": None, "scope": "local", "model": state.index}
        c.meta(schema.UNUSED, info)


def _py_none_grads(params: list[Any]) -> list[int]:
    return [i for i, p in enumerate(params) if p.grad is None]


_none_grads = getattr(fastpath.module(), "none_grads", _py_none_grads)  # the C loop where built


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
        prev = c.progress  # c.enter and c.leave, inlined: once per step
        t0 = _now()
        c.progress = (_BACKWARD, _ALLREDUCE, c.progress_seq(), t0)
        timer = _ct.ACTIVE
        span = timer.begin(_ct.DEV_BACKWARD, c.step) if timer else None
        try:
            result = backward(*args, **kwargs)
        except BaseException as exc:
            _backward_raised(c, prev, None, (), exc)
            raise
        finally:
            if span is not None:
                timer.finish(span)  # type: ignore[union-attr]
        if c.native_settling:  # the buckets DDP laid out in this backward, before its record
            commhook.drain_settling(c)
        runq = run_queue_us()
        c.progress = prev
        c.events += 1
        c.pack(c.backward_kind, t0, _now(), c.step, (runq,))
        try:
            check_unused(c)
        except Exception as exc:
            c.fail("unused", exc)
        return result

    helpers = (commhook.drain_settling, check_unused, note_unused)
    probe = _in_c(True, backward, backward_, _backward_raised, helpers, LivePhase.BACKWARD, _ALLREDUCE, "")
    if probe is None:
        return backward_

    def backward_c(*args: Any, **kwargs: Any) -> Any:
        return probe(args, kwargs)

    return backward_c


def _backward_raised(c: _c.Collector, prev: Any, state: Any, fields: Any, exc: BaseException) -> None:
    """A recorded backward raised: its ``raised`` record (the C probe's callback's signature)."""
    c.raised(prev, schema.BACKWARD, run_queue_us())
