"""How a rank left the training loop the others still run: it ran out of data, or it left by
its own decision, and then by which way out (from the stacks and the script). ``causes.py``
asks when a rank's ledger ends before the others'."""

from __future__ import annotations

from typing import Any

from ddpdoctor.analysis.failed.passes import batches
from ddpdoctor.analysis.failed.points import Ledger
from ddpdoctor.analysis.failed.rankonly import parted_at
from ddpdoctor.analysis.failed.source import in_their_loop, loop_left
from ddpdoctor.analysis.findings import Finding

FIX_LEFT = (
    "Keep every rank in the loop until every rank stops: a return, break or sys.exit() decided on "
    "one rank (or an exception caught and swallowed there) must become a decision every rank "
    "shares (all_reduce a stop or error flag, then stop together), or re-raise the exception."
)


def ran_out(ledger: Ledger, others: list[Ledger]) -> bool:
    """Did this rank finish its data while another rank read more batches in the same pass, or
    was still in that pass with more batches in all (longer passes before it, or a longer one)?"""
    if not ledger.passes:  # no DataLoader seen: the ranks' own slicing; fewer steps is all we
        return not _still_in_loop(ledger, others)  # know, unless its stack is in their loop
    mine = len(ledger.passes) - 1
    last = ledger.passes[mine]
    if not last.complete:
        return False
    had = batches(ledger.passes, last.loader)
    for other in others:
        if len(other.passes) > mine and other.passes[mine].read > last.read:
            return True
        # still in that pass (its loader: the one at the same place in the order), more in all
        in_it = len(other.passes) == mine + 1
        if in_it and batches(other.passes, other.passes[mine].loader, to_come=True) > had:
            return True
    return not any(len(o.passes) > mine for o in others)


def _still_in_loop(root: Ledger, others: list[Ledger]) -> bool:
    """The root's stack and the others' part in one function, and the root's line there lies in
    the innermost loop that holds theirs: it waits inside the loop (a call in a branch of its
    iteration), not after a loop it ran out of."""
    stacks = {lg.rank: lg.stack for lg in (root, *others)}
    parted = parted_at(stacks, [[root.rank], [o.rank for o in others]])
    if parted is None:
        return False
    path, _func, at_root, at_others = parted
    return bool(in_their_loop(path, at_root, at_others))


def shares(root: Ledger, others: list[Ledger]) -> str:
    """What made the passes unequal, from the loaders' own lengths: "; its DataLoader (iterated
    at train.py:82) gives 8 batches a pass, from 96 samples, rank 0's 9, from 108 samples: the
    ranks' datasets differ in length (...)" ("" where the lengths are not known or agree)."""
    if not root.passes or root.passes[-1].expected is None:
        return ""
    i = len(root.passes) - 1
    mine = root.passes[i]
    theirs = {
        o.rank: o.passes[i]
        for o in others
        if len(o.passes) > i and o.passes[i].expected not in (None, mine.expected)
    }
    if not theirs:
        return ""

    def size(p: Any) -> str:
        return f", from {p.samples:,} samples" if p.samples is not None else ""

    at = f" (iterated at {mine.site})" if mine.site else ""
    said = "; ".join(f"rank {r}'s {p.expected}{size(p)}" for r, p in sorted(theirs.items()))
    lengths = {p.samples for p in theirs.values()} | {mine.samples}
    if None in lengths:
        why = ""
    elif len(lengths) > 1:
        why = (
            ": the ranks' datasets differ in length (each rank builds or is given a shard of its own "
            "size: start where that shard is made)"
        )
    else:
        by = f", a {mine.sampler}" if mine.sampler else ""
        why = f": the same number of samples on every rank, dealt into unequal batches by its sampler{by}"
    return f"; its DataLoader{at} gives {mine.expected} batches a pass{size(mine)}, {said}{why}"


def left_by(root: Ledger, others: list[Ledger]) -> str:
    """How a rank left the training loop the others still run (it read no DataLoader, or left
    its pass before the end), from the stacks and the source: "the `break` at train.py:98, under
    `if stop:` (train.py:97)", in the function where the stacks part or, when the root has left the
    function the others are in, in that one; "" (a ``for`` loop that ran out of its items, no
    stacks, no file)."""
    if (root.passes and root.passes[-1].complete) or not others:
        return ""  # it read its whole pass: it ran out of batches
    stacks = {lg.rank: lg.stack for lg in (root, *others)}
    parted = parted_at(stacks, [[root.rank], [o.rank for o in others]])
    if parted is None:
        return _left_function(root, others)
    path, func, at_root, at_others = parted
    found = loop_left(path, func, at_others, at_root)
    if found is None:  # the others are one call deeper, in a loop of a function the root left
        theirs = others[0].stack
        k = next((i for i, f in enumerate(theirs) if f == (path, at_others, func)), -1)
        deeper = theirs[k + 1] if 0 <= k < len(theirs) - 1 else None
        if deeper is not None and all(o.stack == theirs for o in others):
            path, line, func = deeper
            found = loop_left(path, func, line, None)
    return f"the {found[1]}" if found else ""


def _left_function(root: Ledger, others: list[Ledger]) -> str:
    """A rank that exited cleanly, with no stack of its own and nothing raised at its last sync
    points: the one way out (a ``return`` or ``break``) of the loops the others' stacks are
    still in, from the innermost frame that has one."""
    if root.stack or root.ending.how != "clean_exit" or any(p.raised for p in root.points[-3:]):
        return ""
    theirs = others[0].stack
    if not theirs or any(o.stack != theirs for o in others):
        return ""
    for path, line, func in reversed(theirs):
        found = loop_left(path, func, line, None)
        if found is not None:
            return f"the {found[1]}"
    return ""


def left_loop(root: Ledger, left: str, then: str, others: str, details: dict[str, Any]) -> Finding:
    """A rank that left the training loop by its own decision while the others went on."""
    details = {**details, "root_rank": root.rank, "left_by": left}
    return Finding(
        "rank_left_early",
        "error",
        [root.rank],
        f"rank {root.rank} left the training loop after step {root.last_step} by {left} and {then}, "
        f"while {others}: the ranks decided differently whether to go on",
        fix=FIX_LEFT,
        details=details,
    )
