"""Lightning's ``self.log(..., sync_dist=True)``: the user's line behind a collective Lightning
issues later (when it computes the logged metric, outside the hook). A metric logged with
sync_dist on some ranks only leaves the others out of that all-reduce; the collective's own
stack names only Lightning's loop and ``trainer.fit``, so the hook line is recorded here, once
per (site, metric name): one meta record, no cost after the first call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ddpdoctor.probes import callsite
from ddpdoctor.probes import collector as _c
from ddpdoctor.probes.patching import patch
from ddpdoctor.trace import schema

PROBE = "lightning"
_MODULES = ("lightning.pytorch.core.module", "pytorch_lightning.core.module")
_seen: set[tuple[int, str]] = set()


def install() -> None:
    """Patch LightningModule.log when Lightning is loaded (it is, by the time it initialises
    the process group inside ``trainer.fit``)."""
    for name in _MODULES:
        module = sys.modules.get(name)
        cls = getattr(module, "LightningModule", None) if module is not None else None
        if cls is not None:
            patch(cls, "log", _wrap_log)


def _wrap_log(log: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        c = _c.ACTIVE
        if c is not None and kwargs.get("sync_dist") and PROBE not in c.disabled:
            try:
                site = callsite.site(c)
                key = (site, str(name))
                if key not in _seen:
                    _seen.add(key)
                    c.meta(schema.SYNC_LOG, {"site": site, "name": str(name)})
            except Exception as exc:
                c.fail(PROBE, exc)
        return log(self, name, *args, **kwargs)

    return wrapper
