"""Optimizer steps, through torch's global step hooks (no method is patched).

A probe of its own, so a failure elsewhere (say, in the DataLoader probe) never silences it.
An optimizer that steps another inside its own step (``ZeroRedundancyOptimizer``, Lookahead,
a framework's wrapper) fires the hooks twice, nested: only the outer step is the step. Its
record spans the whole of it, and the fingerprint after it sees the parameters once the wrapper
has synchronised them (ZeRO broadcasts each rank's shard after the inner step).

In a training loop's steady state the hooks torch calls are the C module's (``_fast_opt.c``),
which do what ``_pre`` and ``_post`` do and hand anything unusual to them.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from ddpdoctor.probes import collector as _c
from ddpdoctor.probes import cuda_timing as _ct
from ddpdoctor.probes import fastpath, guard
from ddpdoctor.probes import fingerprint as _fp

PROBE = "optimizer"
_now = time.monotonic_ns
IN_C: dict[str, Any] = {}  # "pre"/"post": the C module's hooks, where they are registered


def install() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    pre, post = _in_c() or (_pre, _post)
    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)


def _in_c() -> tuple[Any, Any] | None:
    """The hooks' steady state in C (``_fast_opt.c``, this module's hooks for everything
    else), or None where the Python hooks run alone."""
    fast = fastpath.module()
    if fast is None:
        return None
    try:
        for name, slow in (("pre", _pre), ("post", _post)):
            IN_C[name] = fast.OptimizerProbe(
                post=name == "post", slow=slow, globals=vars(_c), cuda_globals=vars(_ct), fp_globals=vars(_fp)
            )
        return IN_C["pre"], IN_C["post"]
    except Exception as exc:  # a C module from another version of this file
        IN_C.clear()
        guard.passthrough(exc)
        return None


def _pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    c = _c.ACTIVE
    if c is not None:
        # Inside another optimizer's step: not a step of its own. The same optimizer again: its
        # last step raised before its post hook, so this one starts afresh.
        if c.optimizer_t0 and c.optimizer_outer is not None and c.optimizer_outer() is not optimizer:
            return
        c.optimizer_outer = weakref.ref(optimizer)
        c.optimizer_t0 = _now()
        timer = _ct.ACTIVE
        if timer is not None:
            timer.optimizer_span = timer.begin(_ct.DEV_OPTIMIZER, c.step, (type(optimizer).__name__,))


def _post(optimizer: Any, args: Any, kwargs: Any) -> None:
    c = _c.ACTIVE
    if c is None or PROBE in c.disabled or not c.optimizer_t0:
        return
    if c.optimizer_outer is not None and c.optimizer_outer() is not optimizer:
        return  # an inner optimizer's step: the outer one's post hook records the step
    t0, c.optimizer_t0, c.optimizer_outer = c.optimizer_t0, 0, None
    c.events += 1  # c.emit, without its generic interning: once per step
    c.pack(c.optimizer_kind, t0, _now(), c.step, (c.writer.intern(type(optimizer).__name__),))
    timer = _ct.ACTIVE
    if timer is not None and timer.optimizer_span is not None:
        span, timer.optimizer_span = timer.optimizer_span, None
        timer.finish(span)
    _fp.after_step(c, optimizer)  # after the device span: its cost is not the optimizer's
