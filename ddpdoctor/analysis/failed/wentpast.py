"""A call every earlier round made, that one rank went past this time: of ranks in different
collectives at one sequence number (Python calls, or one side in DDP's gradient all-reduce),
after the same call just before, the rank whose own history never had its call follow that
one, while the other ranks' calls did, and whose history had the others' call in between (the
call before, then theirs, then its own). Its early ``return`` or branch skipped the others'
call; named only when every one of these holds. ``causes.py`` asks, from the ledgers' first
divergence (``parting.py``). Where sequence numbers name no root (calls of several process
groups, each numbering its own; rounds that all had both calls), ``went_past_rounds`` asks the
same of each rank's own order of calls, and names an extra call made once more than every
earlier round made it."""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from typing import Any

from ddpdoctor.analysis.failed.order import FIX_REPEATED
from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE, Ledger, Point
from ddpdoctor.analysis.failed.rankonly import others_text
from ddpdoctor.analysis.failed.source import if_holding
from ddpdoctor.analysis.findings import Finding, rank_list

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
        fix=_fix(missed, [root]),
        details={**evidence, "root_rank": root, "place": missed.site, "went_past": missed.describe()},
    )


def went_past_schedule(
    points: dict[int, Point], ledgers: dict[int, Ledger], waiting: list[int], evidence: dict[str, Any]
) -> Finding | None:
    """Ranks (``waiting``) in a call that every rank made at the same steps in each earlier round,
    a fixed number of steps apart, now made again on that schedule, while the other ranks went on
    to a later step without it: they went past it this time. Their rounds were as long as every
    earlier one, so this is no rank running out of batches; the ``if`` that holds the call (from
    the source) decided differently on them."""
    calls = {_key(points[r]) for r in waiting}
    went = {r: p for r, p in points.items() if r not in waiting}
    if len(calls) != 1 or not went:
        return None
    call = points[waiting[0]]
    if not call.site:
        return None
    key = calls.pop()
    done = {
        r: tuple(
            p.step
            for p in ledgers[r].points
            if p.group == "WORLD" and 0 <= p.seq < call.seq and _key(p) == key and not _unfinished(p)
        )
        for r in points
    }
    steps = next(iter(done.values()))
    if len(set(done.values())) != 1 or len(steps) < 2:
        return None
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    period = gaps.pop() if len(gaps) == 1 else 0
    due = steps[-1] + period
    late = any(p.step <= due for p in went.values())
    if period <= 0 or late or any(points[r].step != due for r in waiting):
        return None
    departed = sorted(went)
    ranks = f"rank {departed[0]}" if len(departed) == 1 else f"ranks {', '.join(map(str, departed))}"
    path, line = ledgers[waiting[0]].path_of(call.site)
    test = if_holding(path, call.func, line) if path else None
    shown = ", ".join(map(str, steps[:3])) + (f", ... {steps[-1]}" if len(steps) > 3 else "")
    where = f" in {call.func}()" if call.func and not call.func.startswith("<") else ""
    said = f"`{test[1]}` ({os.path.basename(path)}:{test[0]})" if test else ""
    on = "; ".join(f"rank {r} went on to {p.describe()} without it" for r, p in sorted(went.items()))
    fix = (
        f"The test {said} decides on each rank's own values: decide it from values every rank "
        "shares (all_reduce them first, e.g. the metric averaged over ranks), or make the "
        f"{call.op}() at {call.site} on every rank, outside the `if`."
        if said
        else _fix(call, departed)
    )
    return Finding(
        "rank_only_collective",
        "error",
        departed,
        f"{ranks} went past the {call.op} at {call.site}{where} this time: in each of the {len(steps)} "
        f"earlier rounds every rank made it after the same steps, every {period} steps (after steps "
        f"{shown}); now {'rank' if len(waiting) == 1 else 'ranks'} {rank_list(waiting)} made it on "
        f"schedule, after step {due} (#{call.seq}), while {on}"
        + (f"; the {said} holding it decided differently on {ranks}" if said else "")
        + ". Not uneven inputs: every round so far was as long on every rank",
        fix=fix,
        details={
            **evidence,
            "root_rank": departed[0] if len(departed) == 1 else None,
            "place": call.site,
            "went_past": call.describe(),
            "every_steps": period,
        },
    )


def went_past_rounds(ledgers: dict[int, Ledger], evidence: dict[str, Any]) -> Finding | None:
    """The same question from each rank's own order of calls, where sequence numbers cannot
    line the ranks up (calls of different process groups, each numbering its own) or say nothing
    (every earlier round had both calls in it): each rank's calls, across groups, as runs of one
    call. Every rank ended inside a call; every rank's last run before it is the same call the
    same number of times; every earlier such run, in every rank's history (at least twice), was
    followed by one call. The ranks that ended in that call kept to the rounds; a rank that made
    the last run's call once more made an extra one, and a rank that ended in another went past
    it."""
    stuck = {r: lg.points[-1] for r, lg in ledgers.items() if lg.points and _unfinished(lg.points[-1])}
    if len(stuck) < 2 or len(stuck) != sum(lg.ending.how != "never_started" for lg in ledgers.values()):
        return None
    runs = {r: _runs([_key(p) + (p.group,) for p in ledgers[r].points[:-1]]) for r in stuck}
    if any(not h for h in runs.values()) or len({h[-1] for h in runs.values()}) != 1:
        return None
    last = next(iter(runs.values()))[-1]
    after = {r: [h[i + 1][0] for i in range(len(h) - 1) if h[i] == last] for r, h in runs.items()}
    usual = {k for calls in after.values() for k in calls}
    rounds = min(len(calls) for calls in after.values())
    if len(usual) != 1 or rounds < 2:
        return None
    (then,) = usual
    departed = sorted(r for r, p in stuck.items() if _key(p) + (p.group,) != then)
    kept = {r: p for r, p in stuck.items() if r not in departed}
    if not departed or not kept:
        return None
    groups = len({p.group for p in stuck.values()}) > 1

    def of(group: str) -> str:
        return _of(group) if groups else ""

    (op, site, group), times = last
    ranks = f"rank {departed[0]}" if len(departed) == 1 else f"ranks {', '.join(map(str, departed))}"
    waits = "; ".join(f"rank {r} is in {p.describe()}{of(p.group)}" for r, p in sorted(kept.items()))
    details = {**evidence, "root_rank": departed[0] if len(departed) == 1 else None, "rounds": rounds}
    # One more of the same call: an extra one of theirs. One more gradient all-reduce is the
    # next step's: they went past the call between.
    extra = [r for r in departed if _key(stuck[r]) + (stuck[r].group,) == last[0] and op != GRAD_ALLREDUCE]
    if extra and extra == departed:
        call = stuck[departed[0]]
        return Finding(
            "rank_only_collective",
            "error",
            departed,
            f"{ranks} made the {_named(op, site)}{of(group)} one more time than in any earlier round: "
            f"in each of {rounds} earlier round(s) every rank made it {times} time(s), then "
            f"{_named(then[0], then[1])}; now {ranks} made it a {_nth(times + 1)} time "
            f"({call.describe()}), while {waits}: what {ranks} gave that call to do differed (a dict "
            "or list of metrics of its own, a condition on its own data)",
            fix=FIX_REPEATED,
            details={**details, "place": call.site, "extra": call.describe()},
        )
    if extra:
        return None  # some made one more, some went elsewhere: no one story
    missed = kept[min(kept)]
    where = f" in {missed.func}()" if missed.func and not missed.func.startswith("<") else ""
    went = "; ".join(
        f"rank {r} went straight on to {stuck[r].describe()}{of(stuck[r].group)}" for r in departed
    )
    return Finding(
        "rank_only_collective",
        "error",
        departed,
        f"{ranks} went past the {missed.op} at {missed.site}{where}{of(missed.group)} this time: in "
        f"each of {rounds} earlier round(s), every rank made that call after {times} "
        f"{_named(op, site)}(s){of(group)}; now {went}, while {waits}: something on {ranks} before "
        "that call (a return, a branch on its own data, an exception caught) skipped it",
        fix=_fix(missed, departed),
        details={**details, "place": missed.site, "went_past": missed.describe()},
    )


def _unfinished(p: Point) -> bool:
    return p.in_flight or p.died_in or p.raised


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _runs(keys: list[tuple[str, ...]]) -> list[tuple[tuple[str, ...], int]]:
    """Consecutive equal calls as (call, how many times)."""
    out: list[tuple[tuple[str, ...], int]] = []
    for k in keys:
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1] + 1)
        else:
            out.append((k, 1))
    return out


def _of(group: str) -> str:
    return " (the default group)" if group == "WORLD" else f" (process group {group})"


def _fix(missed: Point, roots: list[int]) -> str:
    who = f"rank {roots[0]}" if len(roots) == 1 else f"ranks {', '.join(map(str, roots))}"
    return (
        f"Make every rank call the {missed.op}() at {missed.site} every time: whatever let {who} "
        "go past it must not hold there only. Contribute a neutral value (zeros) instead of "
        "returning early or skipping it in an except, and decide from the reduced result, or decide "
        "the condition from values every rank shares (all-reduce a flag first)."
    )


def _named(op: str, site: str) -> str:
    """A call by its line; DDP's gradient all-reduce, whose line is the forward's or the
    backward's, by its name alone."""
    return op if op == GRAD_ALLREDUCE or not site else f"{op} at {site}"
