"""Optimizer steps a rank skipped that the others took.

A rank-local decision to skip the update (a loss-spike guard on the rank's own loss, a check of
its own batch) leaves the replicas apart while every collective still matches: DDP's backward
all-reduced the gradients, so nothing hangs and nothing raises; only the update differs. Each
rank's optimizer steps are in its trace (``optimizer`` events, one per ``optimizer.step()``),
so the steps one rank skipped are facts, not a guess.
"""

from __future__ import annotations

from collections import Counter

from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run

FIX = (
    "Decide on every rank alike whether to step: a skip decided from the rank's own loss or batch "
    "must be agreed first (dist.all_reduce a skip flag with ReduceOp.MAX, or the loss, and let "
    "every rank skip together), or decide from the gradients after backward (all-reduced, so the "
    "same on every rank). Every rank must call optimizer.step() at the same steps; then broadcast "
    "rank 0's weights and optimizer state to repair the replicas."
)


def skipped_steps(run: Run, after: int, upto: int) -> dict[int, list[int]]:
    """rank -> the steps in (after, upto] where it ran fewer optimizer steps than another rank,
    up to the last step every rank's record reaches (a rank that died stepped no further)."""
    counts: dict[int, Counter[int]] = {}
    reach = upto
    for rank, trace in run.ranks.items():
        steps = trace.kind(schema.OPTIMIZER).step
        reach = min(reach, int(trace.kind(schema.FORWARD).step.max(initial=-1)))
        counts[rank] = Counter(steps[steps > after].tolist())
    if len(counts) < 2:
        return {}
    every = {s for c in counts.values() for s in c if s <= reach}
    most = {s: max(c.get(s, 0) for c in counts.values()) for s in every}
    out = {r: sorted(s for s in every if c.get(s, 0) < most[s]) for r, c in counts.items()}
    return {r: s for r, s in out.items() if s}


def why(skipped: dict[int, list[int]]) -> str:
    """What the skips were: 'rank 1 skipped optimizer.step() at 5 step(s) the others took (22,
    31, 40, 49, 58): ...'."""
    parts = []
    for rank, steps in sorted(skipped.items()):
        shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
        took = f"{len(steps)} step(s) the others took"
        parts.append(f"rank {rank} skipped optimizer.step() at {took} ({shown})")
    ranks = rank_list(sorted(skipped))
    return (
        "; ".join(parts) + f": from the first skip, rank(s) {ranks} updated differently (every gradient "
        "was all-reduced, every collective matched; only the update differed)"
    )
