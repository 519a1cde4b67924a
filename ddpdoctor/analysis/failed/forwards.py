"""Forwards through the DDP wrapper that some ranks ran and others did not.

The wrapper's forward is a sync point (its buffer broadcast, the unused-parameter map), so a
rank-only forward (a probe, an evaluation through the wrapper) pairs its collective with
whatever the other ranks issue next. A hang shows where the ranks were stuck; the cause is the
first forward they ran at different lines, matched by count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from ddpdoctor.analysis.failed.points import Ledger, Point
from ddpdoctor.analysis.failed.rankonly import others_text
from ddpdoctor.analysis.findings import Finding, rank_list

FIX_FORWARD = (
    "Run rank-only work on the wrapped model, `model.module`, under torch.no_grad() (the DDP "
    "wrapper's forward takes part in collectives: buffer broadcasts, unused-parameter maps), or "
    "run it through the wrapper on every rank."
)


def forward_cause(
    forward_side: dict[int, Point],
    points: dict[int, Point],
    ledgers: dict[int, Ledger],
    details: dict[str, Any],
) -> Finding:
    """Ranks parted at one sequence number, some in the wrapper's forward: the forward side's
    lowest rank is the root, and its place is where the forwards parted, if that came earlier."""
    root = min(forward_side)
    point = forward_side[root]
    kind = "rank_only_eval" if "eval" in point.op else "rank_only_forward"
    place = point.site
    summary = (
        f"rank {root} ran a forward through the DDP wrapper that the others did not "
        f"({point.describe()}), while {others_text(points, root)}: the wrapper's collective "
        "has no partner"
    )
    parted = parted_forward(ledgers, root, [r for r in points if r != root])
    if parted is not None:  # an earlier extra forward put the wrapper's collectives out of step
        place, theirs, count = parted
        summary = (
            f"rank {root} ran an extra forward through the DDP wrapper at {place} (its forward "
            f"#{count + 1}), which the others met with their forward at {theirs}: from there the "
            f"wrapper's collectives were out of step, and rank {root} now waits in "
            f"{point.describe()} while {others_text(points, root)}"
        )
    return Finding(
        kind,
        "error",
        [root],
        summary,
        fix=FIX_FORWARD,
        details={**details, "root_rank": root, "place": place},
    )


def parted_forward(ledgers: dict[int, Ledger], root: int, others: list[int]) -> tuple[str, str, int] | None:
    """(the root's line, the others' line, its count of forwards before it) of the first forward
    the root ran at another line than every other rank ran its forward of that count: an extra
    forward through the wrapper (a rank-only probe, an evaluation) that paired its collective
    with the others' next training forward and put them out of step. The ranks' forwards are
    matched by count (each forward is one of the wrapper's sync points); None when no kept
    forward parts them."""
    mine = ledgers[root]
    for i, (_, _, _, site) in enumerate(mine.forwards):
        count = mine.forwards_from + i
        theirs = []
        for r in others:
            lg = ledgers[r]
            j = count - lg.forwards_from
            if 0 <= j < len(lg.forwards):
                theirs.append(lg.forwards[j][3])
        if site and theirs and all(t and t != site for t in theirs):
            return site, theirs[0], count
    return None


def rank_only_forwards(ledgers: dict[int, Ledger], found: Finding | None) -> Iterable[Finding]:
    """Forwards through the wrapper that some ranks ran at a line and others did not."""
    if found is not None and found.kind in ("rank_only_eval", "rank_only_forward"):
        return
    if any(lg.ending.how not in ("clean_exit", "running") for lg in ledgers.values()):
        return  # a failed job: counts differ because it stopped, the cause is elsewhere
    counts = {
        r: Counter((site, training) for _, grad, training, site in lg.forwards if site and not grad)
        for r, lg in ledgers.items()
    }
    keys = set().union(*[set(c) for c in counts.values()])
    for site, training in sorted(keys):
        per_rank = {r: c.get((site, training), 0) for r, c in counts.items()}
        if len(set(per_rank.values())) == 1:
            continue
        top = max(per_rank.values())
        extra = sorted(r for r, n in per_rank.items() if n == top)
        root = extra[0]
        kind = "rank_only_forward" if training else "rank_only_eval"
        mode = "in training mode under no_grad" if training else "in eval mode"
        yield Finding(
            kind,
            "warning",
            extra,
            f"rank(s) {rank_list(extra)} ran {top} forward(s) through the DDP wrapper at {site} "
            f"({mode}) that rank(s) {rank_list(r for r in per_rank if r not in extra)} did not "
            f"({', '.join(f'rank {r}: {n}' for r, n in sorted(per_rank.items()))}); it did not hang "
            "here, but with buffers or grad enabled it would",
            fix=FIX_FORWARD,
            details={"root_rank": root, "place": site, "forwards": {str(r): n for r, n in per_rank.items()}},
        )
