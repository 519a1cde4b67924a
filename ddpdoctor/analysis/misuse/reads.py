"""What each rank actually read: the digests of every DataLoader pass's first batches.

Sharding and reshuffling are judged by effect: ranks whose passes begin with identical batches
train on the same data, whatever sampler, batch sampler or framework produced them; a pass that
begins as the previous one did replays its order. Digests come from probes/data.py; a run
recorded without them (or from GPU-resident batches) has none, and the findings fall back to
the loader's description.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import RankTrace

Digests = tuple[str, ...]


def passes(trace: RankTrace) -> list[tuple[dict[str, Any], Digests | None]]:
    """Each DataLoader pass of this rank in order: (its loader description, the digests of its
    first batches, or None when none was taken)."""
    got: dict[tuple[Any, int], dict[int, str]] = {}
    for _, _, info in trace.meta.get(schema.BATCHES, []):
        if isinstance(info.get("digest"), str):
            got.setdefault((info.get("id"), int(info.get("pass", -1))), {})[int(info.get("batch", 0))] = info[
                "digest"
            ]
    seen: dict[Any, int] = {}
    out = []
    for _, _, info in trace.meta.get(schema.LOADER, []):
        n = seen.get(info.get("id"), 0)
        seen[info.get("id")] = n + 1
        batches = got.get((info.get("id"), n))
        out.append((info, tuple(batches[i] for i in sorted(batches)) if batches else None))
    return out


def telling(d: Digests | None) -> bool:
    """Digests that can tell orders apart: two or more batches, no two alike (a dataset of
    identical samples, synthetic zeros say, reads the same whatever the order)."""
    return d is not None and len(d) >= 2 and len(set(d)) == len(d)


def replayed(digests: list[Digests | None]) -> bool | None:
    """Did a pass begin with the same batches as the pass before it? None when unknown."""
    pairs = [(a, b) for a, b in zip(digests, digests[1:], strict=False) if telling(a) and telling(b)]
    if not pairs:
        return None
    return any(a == b for a, b in pairs)


def same_data(first: dict[int, Digests | None]) -> bool | None:
    """Did every rank's first training pass begin with identical batches (True), did they read
    different ones (False)? None when a rank's digests are missing or cannot tell."""
    if len(first) < 2 or not all(telling(d) for d in first.values()):
        return None
    return len(set(first.values())) == 1


def unread_epochs(trace: RankTrace, fed: dict[int, int]) -> dict[str, Any] | None:
    """The training loader whose sampler was set to a new epoch after its last pass's batches
    were read, with no pass of the loader after it, while the rank trained at least a whole
    pass's steps after it: those steps' batches were read before (``itertools.cycle(loader)``,
    a list of its batches), in the same order. Its last pass's description with what was set and
    when; None otherwise. (Lightning sets the epoch after the pass began, before its first
    batch: a pass that is still to be read.)"""
    runs = [(ts, info) for ts, _, info in trace.meta.get(schema.LOADER, []) if info.get("id") in fed]
    if not runs or runs[-1][1].get("sampler_id") is None:
        return None
    began, info = runs[-1]
    batches = info.get("batches")
    waits = trace.kind(schema.DATA_WAIT)
    ends = (waits.ts + waits.dur)[waits.ints(0) == info.get("id")]
    read = int(ends.max(initial=began))
    sets = [(ts, step, s) for ts, step, s in trace.meta.get(schema.SET_EPOCH, []) if ts > read]
    later = [
        (step, s)
        for _, step, s in sets
        if s.get("sampler_id") == info["sampler_id"] and s.get("epoch") != info.get("epoch")
    ]
    last = int(trace.kind(schema.FORWARD).step.max(initial=-1))
    if not later or not isinstance(batches, int) or batches < 1 or last - later[0][0] < batches:
        return None
    passes = sum(1 for _, i in runs if i.get("sampler_id") == info["sampler_id"])
    return dict(
        info,
        passes=passes,
        unread=sorted({int(s.get("epoch", 0)) for _, s in later}),
        set_at=later[0][1].get("site"),
        after_step=later[0][0],
        trained=last - later[0][0],
    )
