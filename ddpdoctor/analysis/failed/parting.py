"""Where the ledgers first part ways, and what each rank did there, named only when the facts
for it hold.

``first_divergence`` aligns the ranks' ledgers by sequence number (as torch's Flight Recorder
analyzer aligns its per-rank records) and stops at the first number where they disagree.

Two shapes of a first divergence need more than "the ranks disagree": a call that some ranks
made at a line the others never executed (the rank-only collective: "skipped the barrier" is
said only then), and a DDP sync point the backend matched across different steps (a rank that
skipped a backward, or all-reduced on another accumulation schedule, went on paired with the
wrong partners until something stopped it: the root is that first step, not where it stopped).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ddpdoctor.analysis.failed.ledger import TAIL
from ddpdoctor.analysis.failed.points import BUFFERS, GRAD_ALLREDUCE, Ledger, Point
from ddpdoctor.analysis.failed.signature import NEW_GROUP, Disagreement, disagreement, fix_for
from ddpdoctor.analysis.failed.source import branch_passed
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


@dataclass
class Divergence:
    """Where the ledgers first part ways, and the evidence."""

    what: str  # left | mismatch | steps (one sync point matched across different steps) |
    # accumulation (one all-reduce over a different number of micro-batches on each rank)
    root: int | None
    others: list[int]
    points: dict[int, Point | None]  # each rank's point at the divergence (None: it had none)
    evidence: dict[str, Any] = field(default_factory=dict)


def first_divergence(ledgers: dict[int, Ledger]) -> Divergence | None:
    """The first sync point where ranks disagree: a rank gone while others go on, a different op
    or size at one sequence number, or a collective only some ranks issued."""
    present = {r: lg for r, lg in ledgers.items() if lg.ending.how != "never_started"}
    if len(present) < 2:
        return None
    by_seq = {
        r: {p.seq: p for p in lg.points if p.group == "WORLD" and p.seq >= 0} for r, lg in present.items()
    }
    seqs = sorted(set().union(*[set(m) for m in by_seq.values()]))
    last = {r: max(m, default=-1) for r, m in by_seq.items()}
    batches: dict[int, dict[int, int | None]] = {}  # step -> every rank's micro-batches in it
    for seq in seqs:
        at = {r: m.get(seq) for r, m in by_seq.items()}
        have = {r: p for r, p in at.items() if p is not None}
        if len(have) == len(at):
            # the usual sync point: every rank's the same, nothing to compare field by field
            same = len({p.signature_key() for p in have.values()}) == 1
            sigs = {} if same else {r: p.signature() for r, p in have.items()}
            differ = None if same else disagreement(sigs, _op_of, f"collective #{seq}")
            if differ is None:
                said = _backend_says_mismatch(present, have)
                sized = _sizes_differ(have, present, seq) if said else None
                if sized is not None:
                    return sized
                # completed on no rank (each in it, or raised out of it when the peer died)
                if said and all(p.in_flight or p.raised for p in have.values()):
                    evidence = {"seq": seq, "differs": "size", "backend": said}
                    return Divergence("mismatch", None, [], dict(at), evidence)
                apart = _steps_apart(have) or _accumulation_apart(have, present, batches)
                if apart is not None:
                    return apart
                continue
            differs = {"bytes": "size", "numel": "size"}.get(differ.field, differ.field)
            evidence = {"seq": seq, "differs": differs, "disagreement": differ.text, "field": differ.name}
            return Divergence("mismatch", None, [], dict(at), evidence)
        missing = [r for r in at if at[r] is None]
        if all(last[r] < seq for r in missing):
            gone = min(missing, key=lambda r: (present[r].last_step, r))
            return Divergence("left", gone, sorted(have), dict(at), {"seq": seq})
    return None


def _sizes_differ(have: dict[int, Point], ledgers: dict[int, Ledger], seq: int) -> Divergence | None:
    """Element counts that differ at one sequence number of an op whose sizes some backends let
    differ (``all_gather`` into a list): a mismatch once the backend said so. The root is the one
    rank whose count departs from what its own earlier calls from that line had, when exactly
    one does (a batch short by a dropped sample, say)."""
    counts = {r: p.numel for r, p in have.items() if p.numel > 0}
    if len(counts) < 2 or len(set(counts.values())) == 1:
        return None
    op = next(iter(have.values())).op
    parts = ", ".join(f"rank {r} {n:,} elements" for r, n in sorted(counts.items()))
    text = f"ranks disagree on the {op}'s element count at collective #{seq}: {parts}"
    before = {
        r: {p.numel for p in ledgers[r].points if p.site == have[r].site and p.seq < seq and p.numel > 0}
        for r in counts
    }
    changed = [r for r, n in counts.items() if before[r] and n not in before[r]]
    root = changed[0] if len(changed) == 1 else None
    evidence = {"seq": seq, "differs": "size", "disagreement": text, "field": "element count"}
    if root is not None:
        was = " or ".join(f"{n:,}" for n in sorted(before[root]))
        evidence["changed"] = f"rank {root}'s earlier calls from that line had {was} elements"
    return Divergence("mismatch", root, [r for r in have if r != root], dict(have), evidence)


# DDP's own sync points: issued once per step on every rank, so the step they carry is comparable.
_STEPPED = (GRAD_ALLREDUCE, BUFFERS)


def _steps_apart(have: dict[int, Point]) -> Divergence | None:
    """The same DDP sync point matched across ranks in different steps: the backend paired one
    rank's step k with another's step k+1, because a rank skipped (or added) one before. The
    rank ahead is the one that ran a step without it."""
    if any(p.in_flight or p.op not in _STEPPED for p in have.values()):
        return None
    steps = {r: p.step for r, p in have.items()}
    if len(set(steps.values())) < 2:
        return None
    ahead = max(steps.values())
    root = min(r for r, s in steps.items() if s == ahead)
    others = sorted(r for r in have if steps[r] != ahead)
    seq = next(iter(have.values())).seq
    return Divergence("steps", root, others, dict(have), {"seq": seq, "steps": steps})


def micro_batches(ledger: Ledger, step: int) -> int | None:
    """Grad-mode forwards the rank ran in a step (micro-batches under no_sync() share one), or
    None when the ledger's window of forwards may have cut that step short."""
    steps = ledger.grad_forwards
    if not steps or (len(ledger.forwards) >= TAIL and step <= ledger.first_grad_step):
        return None
    return steps.get(step) or None


def _accumulation_apart(
    have: dict[int, Point],
    ledgers: dict[int, Ledger],
    batches: dict[int, dict[int, int | None]] | None = None,
) -> Divergence | None:
    """One gradient all-reduce, matched in the same step, that averages a different number of
    micro-batches on each rank: their accumulation schedules (no_sync()) differ. The rank that
    ran more forwards per all-reduce skipped the all-reduces the others made. ``batches`` keeps
    each step's counts for the step's other buckets, where ``have`` holds every ledger's rank
    (every all-reduce of a step asks the same: 4 buckets x 1,024 ranks per step at scale)."""
    if any(p.in_flight or p.op != GRAD_ALLREDUCE for p in have.values()):
        return None
    steps = {p.step for p in have.values()}
    if len(steps) != 1:
        return None
    step = steps.pop()
    every = batches is not None and have.keys() == ledgers.keys()
    counts = batches.get(step) if every and batches is not None else None
    if counts is None:
        counts = {r: micro_batches(ledgers[r], step) for r in have}
        if every and batches is not None:
            batches[step] = counts
    if any(n is None for n in counts.values()) or len(set(counts.values())) < 2:
        return None
    most = max(n for n in counts.values() if n is not None)
    root = min(r for r, n in counts.items() if n == most)
    seq = next(iter(have.values())).seq
    evidence = {"seq": seq, "step": step, "micro_batches": counts}
    return Divergence("accumulation", root, sorted(r for r in have if r != root), dict(have), evidence)


def _op_of(sig: dict[str, Any]) -> str:
    return str(sig["op"])


# What a backend prints when the ranks' collectives disagree (gloo's enforce; NCCL's and the
# collective-consistency check's wording), the words a rank leaves when it dies of it.
_MISMATCH_WORDS = ("collective mismatch", "size doesn't match", "sizes don't match", "mismatch between")


def _backend_says_mismatch(ledgers: dict[int, Ledger], at: dict[int, Point]) -> str:
    """The line a rank that died inside this collective left saying the ranks disagree."""
    for rank, point in sorted(at.items()):
        if not point.died_in:
            continue
        for line in ledgers[rank].words:
            if any(w in line.lower() for w in _MISMATCH_WORDS):
                return line.strip()[:300]
    return ""


def rank_only_call(
    points: dict[int, Point], ledgers: dict[int, Ledger], evidence: dict[str, Any]
) -> Finding | None:
    """Ranks in different Python collectives at one sequence number: the call is rank-only when
    its line is one the other ranks never executed (the facts a 'skipped' or 'only rank 0 calls'
    needs); when both lines or neither are, which side is extra is not on record."""
    ops = {r: p.op for r, p in points.items()}
    if len(set(ops.values())) < 2 or any(not p.site for p in points.values()):
        return None
    sites = {r: {q.site for q in ledgers[r].points if q.site} for r in points}
    only = {
        r: p for r, p in points.items()
        if all(p.site not in sites[o] for o in points if ops[o] != p.op)
    }  # fmt: skip
    branch = ""
    if {ops[r] for r in only} == set(ops.values()):  # each side's line is new to the other
        earlier = _earlier(only)
        if not earlier:  # the stacks and the source: which side is inside an if the other passed
            sides = [sorted(r for r in points if ops[r] == op) for op in sorted(set(ops.values()))]
            took = took_branch({r: ledgers[r].stack for r in points}, sides)
            if took is not None:
                earlier, branch = {r: points[r] for r in took[0]}, took[1]
        only = earlier
    if not only or {ops[r] for r in only} == set(ops.values()):
        return None
    root = min(only)
    call = only[root]
    rest = sorted(r for r in points if r not in only)
    if call.op == NEW_GROUP:
        what = (
            f"rank(s) {rank_list(only)} created a process group (new_group at {call.site}) that "
            f"rank(s) {rank_list(rest)} never create: new_group is a collective of the default "
            "group"
        )
        fix = fix_for(Disagreement("op", "op", "", list(only), dict(ops)), call.op)
    elif call.op == "barrier":
        what = (
            f"rank(s) {rank_list(rest)} skipped the barrier at {call.site} that rank(s) "
            f"{rank_list(only)} wait in (they never executed that line)"
        )
        fix = FIX_BRANCH.format(op="dist.barrier")
    else:
        what = (
            f"rank(s) {rank_list(only)} called {call.describe()}, a line rank(s) {rank_list(rest)} "
            "never executed"
        )
        if branch:
            what += f", inside {branch}, which rank(s) {rank_list(rest)} went past"
        fix = FIX_BRANCH.format(op=call.op)
    return Finding(
        "rank_only_collective",
        "error",
        sorted(only),
        f"{what}; {others_text(points, root)}",
        fix=fix,
        details={
            "root_rank": root,
            "place": call.site,
            "seq": call.seq,
            "points": {str(r): p.describe() for r, p in points.items()},
            "ranks": evidence,
        },
    )


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
    behind = []
    for site, side in sides.items():
        rest = [r for r in points if r not in side]
        lines = {
            r: [(q.op, q.site) for q in (by_seq[r].get(k) for k in range(start, seq + 1)) if q]
            for r in points
        }
        if len({tuple(lines[r]) for r in rest}) != 1 or any(len(lines[r]) != seq - start + 1 for r in points):
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


def took_branch(stacks: dict[int, list[Frame]], sides: list[list[int]]) -> tuple[list[int], str] | None:
    """Of two sides at different calls, each at a line the other never executed: (the side
    whose call is inside an ``if`` the other side went past, that ``if`` as "`if <test>:`
    (file:line)"), from their stacks (outermost first) and the source. Below the calls both
    stacks share, the two sides must be in one function at different lines, each side's ranks
    at the same lines; else, or when the source cannot place the lines, None."""
    parted = parted_at(stacks, sides)
    if parted is None:
        return None
    path, func, a, b = parted
    for inside, line, other in ((0, a, b), (1, b, a)):
        found = branch_passed(path, func, line, other)
        if found is not None:
            return sorted(sides[inside]), f"`{found[1]}` ({os.path.basename(path)}:{found[0]})"
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
