"""DataLoader passes: how many batches each pass a rank began would give, and how many it
took (a rank that ran out of batches first is uneven inputs; one that left mid-pass left early)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import RankTrace


@dataclass(frozen=True)
class Pass:
    """One DataLoader pass: how many batches it would give and how many the rank took."""

    loader: int
    expected: int | None
    read: int
    samples: int | None = None  # the loader's dataset length on this rank
    site: str | None = None  # where the rank iterated it
    sampler: str | None = None  # its sampler's class

    @property
    def complete(self) -> bool:
        return self.expected is not None and self.read >= self.expected


def passes(trace: RankTrace, world: int) -> list[Pass]:
    """Each DataLoader pass with the batches it would give and the batches the rank read."""
    loaders = trace.meta.get(schema.LOADER, [])
    if not loaders:
        return []
    waits = trace.kind(schema.DATA_WAIT)
    ts, ids = waits.ts, waits.ints(0)
    out = []
    for i, (t0, _step, info) in enumerate(loaders):
        lid = info.get("id")
        later = [t for t, _, nxt in loaders[i + 1 :] if nxt.get("id") == lid]
        t1 = later[0] if later else None
        mask = (ids == lid) & (ts >= t0)
        if t1 is not None:
            mask &= ts < t1
        n, site, sampler = info.get("dataset_len"), info.get("site"), info.get("sampler")
        out.append(
            Pass(
                int(lid or 0),
                _expected_batches(info, world),
                int(mask.sum()),
                n if isinstance(n, int) else None,
                site if isinstance(site, str) else None,
                sampler if isinstance(sampler, str) else None,
            )
        )
    return out


def _expected_batches(info: dict[str, Any], world: int) -> int | None:
    if isinstance(info.get("batches"), int):
        return info["batches"]
    n, bs = info.get("dataset_len"), info.get("batch_size")
    if not isinstance(n, int) or not isinstance(bs, int) or bs <= 0:
        return None
    if info.get("sampler") == "DistributedSampler":
        n = -(-n // world)
    return n // bs if info.get("drop_last") else -(-n // bs)


def batches(passes: list[Pass], loader: int, to_come: bool = False) -> int:
    """The batches a rank's passes of one loader gave it; ``to_come``: with the rest of the pass
    it is in (what that pass would give, where known)."""
    mine = [p for p in passes if p.loader == loader]
    total = sum(p.read for p in mine)
    if to_come and mine and mine[-1].expected is not None:
        total += max(0, mine[-1].expected - mine[-1].read)
    return total
