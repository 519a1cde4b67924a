"""Checkpoints: ``torch.save`` and ``torch.load`` calls, for the classic checkpoint traps
(every rank writing the same file, loading without map_location, the ``module.`` prefix), and
``load_state_dict`` on a module or an optimizer (with the user's line and, for a module, the
DDP model it belongs to): what explains weights that differ by rank (analysis/misuse/divergence.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from itertools import islice
from typing import Any

from ddpdoctor.probes import callsite
from ddpdoctor.probes import collector as _c
from ddpdoctor.probes import fingerprint as _fp
from ddpdoctor.probes.patching import patch
from ddpdoctor.trace import schema

PROBE = "checkpoint"


def install() -> None:
    import torch
    import torch.serialization

    for owner in (torch, torch.serialization):
        patch(owner, "save", _wrap_save)
        patch(owner, "load", _wrap_load)
    patch(torch.nn.Module, "load_state_dict", _wrap_load_state("model"))
    patch(torch.optim.Optimizer, "load_state_dict", _wrap_load_state("optimizer"))


def _path(f: Any) -> str | None:
    return os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else None


def _module_prefixed(obj: Any) -> bool:
    """A state_dict taken from the DDP wrapper (keys 'module.x') or the wrapper itself."""
    if type(obj).__name__ == "DistributedDataParallel":
        return True
    return isinstance(obj, dict) and any(
        isinstance(k, str) and k.startswith("module.") for k in islice(obj, 8)
    )


def _wrap_save(save: Callable[..., Any]) -> Callable[..., Any]:
    def save_(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        c = _c.ACTIVE
        t0 = time.monotonic_ns()
        result = save(obj, f, *args, **kwargs)
        if c is not None and PROBE not in c.disabled:
            try:
                c.meta(
                    schema.SAVE,
                    {
                        "path": _path(f),
                        "module_prefix": _module_prefixed(obj),
                        "ms": round((time.monotonic_ns() - t0) / 1e6, 3),
                    },
                )
            except Exception as exc:
                c.fail(PROBE, exc)
        return result

    return save_


def _wrap_load(load: Callable[..., Any]) -> Callable[..., Any]:
    def load_(f: Any, *args: Any, **kwargs: Any) -> Any:
        c = _c.ACTIVE
        if c is not None and PROBE not in c.disabled:
            try:
                mapped = bool(args) or kwargs.get("map_location") is not None
                c.meta(schema.LOAD, {"path": _path(f), "map_location": mapped})
            except Exception as exc:
                c.fail(PROBE, exc)
        return load(f, *args, **kwargs)

    return load_


def _wrap_load_state(target: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(load_state_dict: Callable[..., Any]) -> Callable[..., Any]:
        def load_state_dict_(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = load_state_dict(self, *args, **kwargs)
            c = _c.ACTIVE
            if c is not None and PROBE not in c.disabled:
                try:
                    info = {"target": target, "class": type(self).__name__, "site": callsite.site(c)}
                    if target == "model":
                        info["model"] = _model_of(self)
                    c.meta(schema.LOAD_STATE, info)
                except Exception as exc:
                    c.fail(PROBE, exc)
            return result

        return load_state_dict_

    return wrap


def _model_of(module: Any) -> int | None:
    """The index of the DDP model ``module`` is (or is inside), None when it is in none yet."""
    fp = _fp.ACTIVE
    for model in fp.models if fp is not None else ():
        ddp = model.ref()
        if ddp is not None and (module is ddp or any(m is module for m in ddp.module.modules())):
            return model.index
    return None
