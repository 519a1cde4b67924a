"""Optimizer steps, through torch's global step hooks (no method is patched).

A probe of its own, so a failure elsewhere (say, in the DataLoader probe) never silences it.
"""

from __future__ import annotations

import time
from typing import Any

from ddpdoctor.probes import collector as _c
from ddpdoctor.probes import cuda_timing as _ct
from ddpdoctor.probes import fingerprint as _fp
from ddpdoctor.trace import schema

PROBE = "optimizer"
_now = time.monotonic_ns


def install() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_pre)
    register_optimizer_step_post_hook(_post)


def _pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    c = _c.ACTIVE
    if c is not None:
        c.optimizer_t0 = _now()
        timer = _ct.ACTIVE
        if timer is not None:
            timer.optimizer_span = timer.begin(_ct.DEV_OPTIMIZER, c.step, (type(optimizer).__name__,))


def _post(optimizer: Any, args: Any, kwargs: Any) -> None:
    c = _c.ACTIVE
    if c is None or PROBE in c.disabled or not c.optimizer_t0:
        return
    t0, c.optimizer_t0 = c.optimizer_t0, 0
    c.emit(schema.OPTIMIZER, t0, _now(), type(optimizer).__name__)
    timer = _ct.ACTIVE
    if timer is not None and timer.optimizer_span is not None:
        span, timer.optimizer_span = timer.optimizer_span, None
        timer.finish(span)
    _fp.after_step(c, optimizer)  # after the device span: its cost is not the optimizer's
