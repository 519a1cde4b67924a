"""A call every earlier round made, that one rank went past this time: of ranks in different
collectives at one sequence number (Python calls, or one side in DDP's gradient all-reduce),
after the same call just before, the rank whose own history never had its call follow that
one, while the other ranks' calls did, and whose history had the others' call in between (the
call before, then theirs, then its own). Its early ``return`` or branch skipped the others'
call; named only when every one of these holds. ``causes.py`` asks, from the ledgers' first
divergence (``parting.py``)."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE, Ledger, Point
from ddpdoctor.analysis.failed.rankonly import others_text
from ddpdoctor.analysis.findings import Finding

Key = tuple[str, str]  # (op, site): one call of the program


def _key(p: Point) -> Key:
    """One call of the program: a collective by its line, DDP's gradient all-reduce by the op
    alone (its records carry the step's forward line; one a hang found, the backward's)."""
    return (p.op, "" if p.op == GRAD_ALLREDUCE else p.site)


def _follows(ledger: Ledger, before: int) -> dict[Key, Counter[Key]]:
    """call -> the calls that came right after it (by sequence number), below ``before``."""
    world = [p for p in ledger.points if p.group == "WORLD" and 0 <= p.seq < before]
    world.sort(key=lambda p: p.seq)
    out: dict[Key, Counter[Key]] = defaultdict(Counter)
    for a, b in zip(world, world[1:]):
        if b.seq == a.seq + 1:
            out[_key(a)][_key(b)] += 1
    return out


def went_past(
    points: dict[int, Point], ledgers: dict[int, Ledger], evidence: dict[str, Any]
) -> Finding | None:
    if len(points) < 2 or any(not p.site for p in points.values()):
        return None
    seq = next(iter(points.values())).seq
    prev: dict[int, Key] = {}
    for r in points:
        p = next((q for q in ledgers[r].points if q.group == "WORLD" and q.seq == seq - 1), None)
        if p is None:
            return None
        prev[r], before_site = _key(p), p.site
    if len(set(prev.values())) != 1:
        return None
    before = next(iter(prev.values()))
    follows = {r: _follows(ledgers[r], seq) for r in points}
    usual = {r: follows[r][before][_key(p)] > 0 for r, p in points.items()}
    departed = [r for r, ok in usual.items() if not ok and follows[r][before]]
    if len(departed) != 1 or sum(usual.values()) != len(points) - 1:
        return None
    root = departed[0]
    missed = next(p for r, p in sorted(points.items()) if r != root)
    own = points[root]
    mine = follows[root]
    if any(_key(p) != _key(missed) for r, p in points.items() if r != root):
        return None
    rounds = min(mine[before][_key(missed)], mine[_key(missed)][_key(own)])
    if rounds == 0:
        return None
    where = f" in {missed.func}()" if missed.func and not missed.func.startswith("<") else ""
    if before == _key(own):
        between = f"between one {own.op} and the next"
    else:
        between = f"after the {_named(before[0], before_site)} and before the {_named(own.op, own.site)}"
    return Finding(
        "rank_only_collective",
        "error",
        [root],
        f"rank {root} went past the {missed.op} at {missed.site}{where} this time: in each of its "
        f"{rounds} earlier round(s) it made that call {between}; now it went straight to "
        f"{own.describe()}, while "
        f"{others_text(points, root)}: something on rank {root} before that call (a return, a "
        "branch on its own data, an exception caught) skipped it",
        fix=(
            f"Make every rank call the {missed.op}() at {missed.site} every time: whatever let rank "
            f"{root} go past it must not hold on one rank only. Contribute a neutral value (zeros) "
            "instead of returning early, and decide from the reduced result, or decide the "
            "condition from values every rank shares (all-reduce a flag first)."
        ),
        details={**evidence, "root_rank": root, "place": missed.site, "went_past": missed.describe()},
    )


def _named(op: str, site: str) -> str:
    """A call by its line; DDP's gradient all-reduce, whose line is the forward's or the
    backward's, by its name alone."""
    return op if op == GRAD_ALLREDUCE or not site else f"{op} at {site}"
