"""Optimizer steps, through torch's global step hooks (no method is patched).

A probe of its own, so a failure elsewhere (say, in the DataLoader probe) never silences it.
An optimizer that steps another inside its own step (``ZeroRedundancyOptimizer``, Lookahead,
a framework's wrapper) fires the hooks twice, nested: only the outer step is the step. Its
record spans the whole of it, and the fingerprint after it sees the parameters once the wrapper
has synchronised them (ZeRO broadcasts each rank's shard after the inner step).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from ddpdoctor.probes import collector as _c
from ddpdoctor.probes import cuda_timing as _ct
from ddpdoctor.probes import fingerprint as _fp

PROBE = "optimizer"
_now = time.monotonic_ns


def install() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_pre)
    register_optimizer_step_post_hook(_post)


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
