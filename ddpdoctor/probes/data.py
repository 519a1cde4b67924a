"""DataLoader waits, DataLoader passes (sampler, epoch, batch size) and optimizer steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ddpdoctor.probes import collector as _c
from ddpdoctor.probes import cuda_timing as _ct
from ddpdoctor.probes.patching import patch
from ddpdoctor.trace import schema

PROBE = "data"
_now = time.monotonic_ns
_LOADER_ID = "_ddpdoctor_loader"


def install() -> None:
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    from torch.utils.data import dataloader

    patch(dataloader._BaseDataLoaderIter, "__next__", _wrap_next)
    patch(dataloader.DataLoader, "__iter__", _wrap_iter)
    register_optimizer_step_pre_hook(_optimizer_pre)
    register_optimizer_step_post_hook(_optimizer_post)


def _wrap_next(next_: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def __next__(self: Any) -> Any:
        c = _c.ACTIVE
        if c is None or PROBE in c.disabled:
            return next_(self)
        t0 = _now()
        prev, c.progress = c.progress, ("data", "next", -1, t0)
        try:
            batch = next_(self)
        finally:
            c.progress = prev
        c.emit(schema.DATA_WAIT, t0, _now(), getattr(self, _LOADER_ID, 0))
        return batch

    return __next__


def _wrap_iter(iter_: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def __iter__(self: Any) -> Any:
        it = iter_(self)
        c = _c.ACTIVE
        if c is None or PROBE in c.disabled:
            return it
        try:
            setattr(it, _LOADER_ID, id(self))
            c.meta(schema.LOADER, describe_loader(self))
        except Exception as exc:
            c.fail(PROBE, exc)
        return it

    return __iter__


def describe_loader(loader: Any) -> dict[str, Any]:
    """What the misuse findings need: sampler type, its epoch and shuffle, batch sizes."""
    sampler = loader.sampler
    try:
        dataset_len: int | None = len(loader.dataset)
    except Exception:
        dataset_len = None
    return {
        "id": id(loader),
        "sampler": type(sampler).__name__,
        "sampler_id": id(sampler),
        "epoch": getattr(sampler, "epoch", None),
        "shuffle": bool(getattr(sampler, "shuffle", type(sampler).__name__ == "RandomSampler")),
        "batch_size": loader.batch_size,
        "drop_last": bool(loader.drop_last),
        "num_workers": int(loader.num_workers),
        "dataset_len": dataset_len,
        "batch_sampler": type(loader.batch_sampler).__name__ if loader.batch_sampler else None,
    }


def _optimizer_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    c = _c.ACTIVE
    if c is not None:
        c.optimizer_t0 = _now()
        timer = _ct.ACTIVE
        if timer is not None:
            timer.optimizer_span = timer.begin(_ct.DEV_OPTIMIZER, c.step, (type(optimizer).__name__,))


def _optimizer_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    c = _c.ACTIVE
    if c is None or PROBE in c.disabled or not c.optimizer_t0:
        return
    t0, c.optimizer_t0 = c.optimizer_t0, 0
    c.emit(schema.OPTIMIZER, t0, _now(), type(optimizer).__name__)
    timer = _ct.ACTIVE
    if timer is not None and timer.optimizer_span is not None:
        span, timer.optimizer_span = timer.optimizer_span, None
        timer.finish(span)
