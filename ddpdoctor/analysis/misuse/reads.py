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
