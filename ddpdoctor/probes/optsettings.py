"""An optimizer's settings (learning rate, momentum, weight decay, betas... per param group), as
the rank applies them: a scheduler stepped with each rank's own metric, or a learning rate worked
out from the rank's own shard, trains the replicas apart with no error, and only the weights show
it. Noted when they changed since the rank's last note of that optimizer, at two moments: the
fingerprint checks (``fingerprint.py``: a change made by hand is seen there), and right after a
learning-rate scheduler's ``step()`` (a scheduler may move the rate for a few steps between two
checks), for the first ``SCHEDULER_NOTES`` of an optimizer's changes (a per-step schedule changes
it every step). The analysis reads a rank's settings at a step as its last note at or before it
(``analysis/misuse/settings.py``). Never in a step's own work: a scheduler's step and a check."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

from ddpdoctor.probes import callsite
from ddpdoctor.probes.patching import patch
from ddpdoctor.trace import schema

SKIP = frozenset(("params", "param_names", "initial_lr"))  # not settings: bookkeeping
SCHEDULER_NOTES = 256  # per optimizer: enough for every epoch-wise change, bounded for per-step ones


def value(v: Any) -> Any:
    """A setting as JSON holds it, or None for what is not a setting of numbers (flags as None
    or strings: foreach, fused). A one-element tensor (a capturable optimizer's lr) only on the
    host: reading a device tensor would wait for the device."""
    if isinstance(v, bool | int | float):
        return v
    if isinstance(v, tuple | list):
        items = [value(x) for x in v]
        return items if items and all(x is not None for x in items) else None
    if getattr(v, "device", None) is not None and getattr(v.device, "type", "") == "cpu" and v.numel() == 1:
        return float(v)
    return None


def settings(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each param group's settings, in group order (``optimizer.param_groups``)."""
    out = []
    for group in groups:
        kept = {k: value(v) for k, v in group.items() if k not in SKIP}
        out.append({k: v for k, v in kept.items() if v is not None})
    return out


class Notes:
    """The settings last noted per optimizer, so that a note is written only on a change."""

    def __init__(self) -> None:
        self.last: dict[int, list[dict[str, Any]]] = {}
        self.by_scheduler: dict[int, int] = {}
        self.rates: dict[int, tuple] = {}  # the learning rates a scheduler step last saw
        self.refs: dict[int, Any] = {}  # key -> weakref to the optimizer, for the exit's note
        self.optimizers: dict[int, int] = {}  # id -> index, in order of first step (or note)
        self.keys = 0  # optimizers numbered so far

    def key_of(self, optimizer: Any) -> int:
        """The optimizer's index: a new one for each optimizer, its id's reuse included (an
        optimizer freed is forgotten, ``gone``)."""
        key = self.optimizers.get(id(optimizer))
        if key is None:
            key = self.optimizers[id(optimizer)] = self.keys
            self.keys += 1
        return key

    def note(self, fp: Any, optimizer: Any, by: str) -> None:
        """Write ``fp``'s rank a note of ``optimizer``'s settings if they changed (``fp``: the
        rank's ``fingerprint.Fingerprints``; ``by``: "check" or "scheduler")."""
        key = self.key_of(optimizer)
        if key not in self.refs:  # its last settings as it goes: a main() that returns frees it
            self.refs[key] = weakref.ref(optimizer)  # before the exit check runs
            args = (fp, key, id(optimizer), type(optimizer).__name__, optimizer.param_groups)
            weakref.finalize(optimizer, self.gone, *args).atexit = False
        if by == "scheduler":  # a step per training step, often: the rates first, a few µs
            if self.by_scheduler.get(key, 0) >= SCHEDULER_NOTES:
                return
            rates = tuple(value(g.get("lr")) for g in optimizer.param_groups)
            if self.rates.get(key) == rates:
                return
            self.rates[key] = rates
        self.write(fp, key, type(optimizer).__name__, optimizer.param_groups, by)

    def write(self, fp: Any, key: int, name: str, groups: list[dict[str, Any]], by: str) -> None:
        now = settings(groups)
        if self.last.get(key) == now:
            return
        self.last[key] = now
        info: dict[str, Any] = {"optimizer": key, "type": name, "by": by, "groups": now}
        if by == "scheduler":  # the user's line that stepped it
            self.by_scheduler[key] = self.by_scheduler.get(key, 0) + 1
            info["site"] = callsite.site(fp.c)
        ns = time.monotonic_ns()
        fp.emit((schema.OPT_SETTINGS, ns, ns, fp.c.step, info))

    def note_all(self, fp: Any) -> None:
        """Every live optimizer's settings, at a check with no optimizer step (the exit's)."""
        for ref in list(self.refs.values()):
            optimizer = ref()
            if optimizer is not None:
                self.note(fp, optimizer, "check")

    def gone(self, fp: Any, key: int, ident: int, name: str, groups: list[dict[str, Any]]) -> None:
        """An optimizer was freed: its last settings, as the exit check would have noted them
        ("gone": the garbage collector may free it at another step on each rank, so the analysis
        compares it no later than its first such note), and its id forgotten."""
        from ddpdoctor.probes.fingerprint import PROBE

        if self.optimizers.get(ident) == key:
            del self.optimizers[ident]
        self.refs.pop(key, None)
        if fp.c.live and PROBE not in fp.c.disabled:
            try:
                self.write(fp, key, name, groups, "gone")
            except Exception as exc:
                fp.c.fail(PROBE, exc)


def install() -> None:
    """After every learning-rate scheduler's ``step()``: the settings, when they changed. Each
    class of torch's that defines its own ``step`` (``ReduceLROnPlateau``, ``SequentialLR``...)
    and the base class the others inherit it from."""
    from torch.optim import lr_scheduler

    from ddpdoctor.probes import collector, fingerprint

    def wrap(step: Callable[..., Any]) -> Callable[..., Any]:
        def step_(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = step(self, *args, **kwargs)
            fp, optimizer = fingerprint.ACTIVE, getattr(self, "optimizer", None)
            on = fp is not None and fp.c is collector.ACTIVE and fingerprint.PROBE not in fp.c.disabled
            if on and optimizer is not None:
                try:
                    fp.settings.note(fp, optimizer, "scheduler")
                except Exception as exc:
                    fp.c.fail(fingerprint.PROBE, exc)
            return result

        return step_

    for cls in vars(lr_scheduler).values():
        if isinstance(cls, type) and issubclass(cls, lr_scheduler.LRScheduler) and "step" in vars(cls):
            patch(cls, "step", wrap)
