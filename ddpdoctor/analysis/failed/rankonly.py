"""The rank-only collective: of ranks in different collectives at one sequence number, the
side that made a call the others never made, named only when the facts for it hold (its line
is one the others never executed; or it ran one call behind from an earlier extra call; or
Lightning synced a metric only some ranks logged). ``causes.py`` asks, from the ledgers' first
divergence (``parting.py``)."""

from __future__ import annotations

import os
from typing import Any

from ddpdoctor.analysis.failed.points import Ledger, Point
from ddpdoctor.analysis.failed.signature import NEW_GROUP, Disagreement, fix_for
from ddpdoctor.analysis.failed.source import branch_passed, if_holding, went_past
from ddpdoctor.analysis.failed.stacks import Frame
from ddpdoctor.analysis.findings import Finding, rank_list

FIX_BRANCH = (
    "Call {op}() on every rank: move it out of the rank-dependent branch (`if rank == 0:`), or do "
    "the rank-only work without a collective."
)
FIX_EXTRA = (
    "Make the {op}() at {site} a call every rank makes, or none: it ran under a condition only "
    "rank(s) {ranks} met (a rank-dependent branch, or a test of the rank's own data). Decide the "
    "condition from values every rank shares (all-reduce a flag first), or do that work without "
    "a collective."
)
FIX_SYNC_LOG = (
    "In Lightning: log on every rank (call self.log(..., sync_dist=True) outside `if "
    "self.trainer.is_global_zero:`), or log rank 0's value alone with self.log(..., "
    "rank_zero_only=True) and no sync_dist."
)


def rank_only_call(
    points: dict[int, Point], ledgers: dict[int, Ledger], evidence: dict[str, Any]
) -> Finding | None:
    """Ranks in different Python collectives at one sequence number: the call is rank-only when
    its line is one the other ranks never executed (the facts a 'skipped' or 'only rank 0 calls'
    needs); when both lines or neither are, which side is extra is not on record. A side whose
    stack is inside an ``if`` the other side went past, at an earlier line of the function both
    are in, has not reached the other side's line yet: its never having executed that line says
    nothing, and its own call, made inside that ``if``, is the extra one (a helper's collective
    every rank calls elsewhere, reached from a rank-0-only branch)."""
    ops = {r: p.op for r, p in points.items()}
    if len(set(ops.values())) < 2 or any(not p.site for p in points.values()):
        return None
    sites = {r: {q.site for q in ledgers[r].points if q.site} for r in points}
    only = {
        r: p for r, p in points.items()
        if all(p.site not in sites[o] for o in points if ops[o] != p.op)
    }  # fmt: skip
    sides = [sorted(r for r in points if ops[r] == op) for op in sorted(set(ops.values()))]
    stacks = {r: ledgers[r].stack for r in points}
    branch, via, under = "", "", ""
    if {ops[r] for r in only} == set(ops.values()):  # each side's line is new to the other
        earlier = _earlier(only)
        if not earlier:  # the stacks and the source: which side is inside an if the other passed
            took = took_branch(stacks, sides)
            if took is not None:
                earlier, branch, under = {r: points[r] for r in took[0]}, took[1], took[2]
        only = earlier
    elif only and (took := took_branch(stacks, sides)) is not None and set(took[0]) != set(only):
        only, branch, under = {r: points[r] for r in took[0]}, took[1], took[2]
    if not only or {ops[r] for r in only} == set(ops.values()):
        return None
    root = min(only)
    call = only[root]
    rest = sorted(r for r in points if r not in only)
    place = call.site
    if branch:  # the way from the branch to the call, where it went through the user's helpers
        theirs = stacks[rest[0]]
        callers = _below_parting(stacks[root], theirs)
        via = "".join(f", from {func}() at {os.path.basename(path)}:{line}" for path, line, func in callers)
        place = under or (f"{os.path.basename(callers[-1][0])}:{callers[-1][1]}" if callers else place)
    new = all(call.site not in sites[o] for o in rest)
    if call.op == NEW_GROUP:
        what = (
            f"rank(s) {rank_list(only)} created a process group (new_group at {call.site}) that "
            f"rank(s) {rank_list(rest)} never create: new_group is a collective of the default "
            "group"
        )
        fix = fix_for(Disagreement("op", "op", "", list(only), dict(ops)), call.op)
    elif call.op == "barrier" and not branch:
        what = (
            f"rank(s) {rank_list(rest)} skipped the barrier at {call.site} that rank(s) "
            f"{rank_list(only)} wait in (they never executed that line)"
        )
        fix = FIX_BRANCH.format(op="dist.barrier")
    else:
        what = f"rank(s) {rank_list(only)} called {call.describe()}{via}"
        if new:
            what += f", a line rank(s) {rank_list(rest)} never executed"
        if branch:
            what += f", inside {branch}, which rank(s) {rank_list(rest)} went past"
        # a helper's test (of the rank's own data, as often as of its rank): the general fix
        fix = (
            FIX_EXTRA.format(op=call.op, site=call.site, ranks=rank_list(only))
            if under
            else FIX_BRANCH.format(op=call.op)
        )
    return Finding(
        "rank_only_collective",
        "error",
        sorted(only),
        f"{what}; {others_text(points, root)}",
        fix=fix,
        details={
            "root_rank": root,
            "place": place,
            "seq": call.seq,
            "points": {str(r): p.describe() for r, p in points.items()},
            "ranks": evidence,
        },
    )


def _below_parting(stack: list[Frame], other: list[Frame]) -> list[Frame]:
    """The frames of ``stack`` (outermost first) from where it parts from ``other`` down to, not
    including, its innermost (the call's own line), innermost first."""
    k = next((i for i, (x, y) in enumerate(zip(stack, other)) if x != y), min(len(stack), len(other)))
    return stack[k:-1][::-1]


def extra_call(
    points: dict[int, Point], ledgers: dict[int, Ledger], evidence: dict[str, Any]
) -> Finding | None:
    """Ranks in different collectives at one sequence number because one side made a call the
    others never made, earlier: from the first number where their lines differ, that side is one
    call behind (each of its later calls is the others' call one number before) and its line
    there is one the others never executed. The root is that call; the mismatch is where it
    showed. Two calls of one signature pair up silently, so it may be several numbers back."""
    seq = min(p.seq for p in points.values())
    by_seq = {r: {q.seq: q for q in ledgers[r].points if q.group == "WORLD" and q.seq >= 0} for r in points}
    start = seq
    while (
        all(start - 1 in m for m in by_seq.values()) and len({by_seq[r][start - 1].site for r in points}) > 1
    ):
        start -= 1
    if start == seq or any(not by_seq[r][start].site for r in points):
        return None
    sides: dict[str, list[int]] = {}
    for r in sorted(points):
        sides.setdefault(by_seq[r][start].site, []).append(r)
    lines = {
        r: [(q.op, q.site) for q in (by_seq[r].get(k) for k in range(start, seq + 1)) if q] for r in points
    }
    if any(len(lines[r]) != seq - start + 1 for r in points):
        return None
    behind = []
    for site, side in sides.items():
        rest = [r for r in points if r not in side]
        if len({tuple(lines[r]) for r in rest}) != 1:
            continue
        theirs = lines[rest[0]]
        new = all(site not in {q.site for q in ledgers[o].points} for o in rest)
        if new and all(lines[r][1:] == theirs[:-1] for r in side):
            behind.append(side)
    if len(behind) != 1:
        return None
    side = behind[0]
    root, rest = side[0], sorted(r for r in points if r not in side)
    call = by_seq[root][start]
    return Finding(
        "rank_only_collective",
        "error",
        side,
        f"rank(s) {rank_list(side)} called {call.describe()}, a line rank(s) {rank_list(rest)} never "
        f"executed; rank(s) {rank_list(rest)} made {by_seq[rest[0]][start].describe()} there, and "
        f"rank(s) {rank_list(side)} made that call next, as #{start + 1}: from there they ran one "
        f"collective behind, and at #{seq} (a consequence) {others_text(points, -1)}",
        fix=FIX_EXTRA.format(op=call.op, site=call.site, ranks=rank_list(side)),
        details={
            "root_rank": root,
            "place": call.site,
            "seq": start,
            "mismatch_seq": seq,
            "points": {str(r): p.describe() for r, p in points.items()},
            "extra": call.describe(),
            "paired_next": by_seq[root][start + 1].describe(),
            "ranks": evidence,
        },
    )


def others_text(points: dict[int, Point], root: int) -> str:
    """Where each rank but ``root`` was: "rank 1 was in barrier #7 at train.py:40; rank 2 ..."."""
    return "; ".join(f"rank {r} was in {p.describe()}" for r, p in sorted(points.items()) if r != root)


def took_branch(stacks: dict[int, list[Frame]], sides: list[list[int]]) -> tuple[list[int], str, str] | None:
    """Of two sides at different calls, each at a line the other never executed: (the side
    whose call is inside an ``if`` the other side went past, that ``if`` as "`if <test>:`
    (file:line)", the line under it where the side's stack goes on), from their stacks
    (outermost first) and the source. Below the calls both stacks share, the two sides must be
    in one function at different lines, each side's ranks at the same lines; else, or when the
    source cannot place the lines, None. The ``if`` is in that function, or, where the other
    side went past the line the side is at there, in a function that line called (a helper's
    test of the rank's own data: the other side ran the helper and never took it)."""
    parted = parted_at(stacks, sides)
    if parted is None:
        return None
    path, func, a, b = parted
    for inside, line, other in ((0, a, b), (1, b, a)):
        found = branch_passed(path, func, line, other)
        if found is not None:
            return sorted(sides[inside]), f"`{found[1]}` ({os.path.basename(path)}:{found[0]})", ""
    for inside, line, other in ((0, a, b), (1, b, a)):
        if not went_past(path, func, line, other):
            continue
        stack = stacks[sides[inside][0]]
        below = stack[next(i for i, f in enumerate(stack) if f[0] == path and f[1] == line) + 1 :]
        for fpath, fline, ffunc in below:
            found = if_holding(fpath, ffunc, fline)
            if found is not None:
                name = os.path.basename(fpath)
                return sorted(sides[inside]), f"`{found[1]}` ({name}:{found[0]})", f"{name}:{fline}"
    return None


def parted_at(stacks: dict[int, list[Frame]], sides: list[list[int]]) -> tuple[str, str, int, int] | None:
    """(path, function, side 0's line, side 1's line) where two sides' stacks (outermost first)
    part: below the calls both share, one function at two lines, each side's ranks alike."""
    if len(sides) != 2 or not all(sides):
        return None
    a, b = (stacks.get(side[0]) or [] for side in sides)
    if not a or not b or any(stacks.get(r) != top for top, side in zip((a, b), sides) for r in side):
        return None
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None or a[k][0] != b[k][0] or a[k][2] != b[k][2]:
        return None  # not two lines of one function below the shared calls
    return a[k][0], a[k][2], a[k][1], b[k][1]


def _earlier(points: dict[int, Point]) -> dict[int, Point]:
    """Of calls whose lines the other side never executed, the extra one: creating a group
    (new_group), or a barrier at the earlier line of one file, which the others passed on their
    way to the later line (two other ops in one file may sit in an if and its else: no guess)."""
    made = {r: p for r, p in points.items() if p.op == NEW_GROUP}
    if made:
        return made
    files = {p.site.rsplit(":", 1)[0] for p in points.values()}
    lines = {r: p.site.rsplit(":", 1)[1] for r, p in points.items()}
    if len(files) != 1 or not all(v.isdigit() for v in lines.values()):
        return {}
    first = min(int(v) for v in lines.values())
    if sum(int(v) == first for v in lines.values()) == len(lines):
        return {}
    earlier = {r: p for r, p in points.items() if int(lines[r]) == first}
    return earlier if all(p.op == "barrier" for p in earlier.values()) else {}


def rank_only_logs(ledgers: dict[int, Ledger], parted: bool, evidence: dict[str, Any]) -> Finding | None:
    """A metric a framework all-reduces (Lightning's sync_dist) that only some ranks logged: the
    others never join that all-reduce. The user's line is the hook's, not trainer.fit."""
    present = {r: lg for r, lg in ledgers.items() if lg.ending.how != "never_started"}
    keys = set().union(*[lg.sync_logs for lg in present.values()]) if present else set()
    for place, name in sorted(keys):
        logged = sorted(r for r, lg in present.items() if (place, name) in lg.sync_logs)
        if len(logged) == len(present):
            continue
        rest = sorted(r for r in present if r not in logged)
        line = place.split(" in ")[0]
        stopped = (
            ": the ranks' collectives parted there and the job stopped (the hang or errors that "
            "followed are consequences)"
            if parted
            else ""
        )
        return Finding(
            "rank_only_collective",
            "error" if parted else "warning",
            logged,
            f"rank(s) {rank_list(logged)} logged {name!r} with sync_dist=True at {place} and rank(s) "
            f"{rank_list(rest)} did not: Lightning all-reduces that metric on the ranks that "
            f"logged it, and the others never join that all-reduce{stopped}",
            fix=FIX_SYNC_LOG,
            details={"root_rank": logged[0], "place": line, "metric": name, "ranks": evidence},
        )
    return None
