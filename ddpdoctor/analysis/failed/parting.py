"""Where the ledgers first part ways, and what each rank did there, named only when the facts
for it hold.

``first_divergence`` aligns the ranks' ledgers by sequence number (as torch's Flight Recorder
analyzer aligns its per-rank records) and stops at the first number where they disagree.

Two shapes of a first divergence need more than "the ranks disagree": a call that some ranks
made at a line the others never executed (the rank-only collective, ``rankonly.py``: "skipped
the barrier" is said only then), and a DDP sync point the backend matched across different steps (a rank that
skipped a backward, or all-reduced on another accumulation schedule, went on paired with the
wrong partners until something stopped it: the root is that first step, not where it stopped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddpdoctor.analysis.failed.ledger import TAIL
from ddpdoctor.analysis.failed.points import BUFFERS, GRAD_ALLREDUCE, Ledger, Point
from ddpdoctor.analysis.failed.signature import disagreement


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
            root, was = _changed(have, present, seq) if differs == "size" else (None, "")
            if root is None:
                return Divergence("mismatch", None, [], dict(at), evidence)
            evidence["changed"] = was
            return Divergence("mismatch", root, [r for r in have if r != root], dict(at), evidence)
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
    root, was = _changed(have, ledgers, seq)
    evidence = {"seq": seq, "differs": "size", "disagreement": text, "field": "element count"}
    if root is not None:
        evidence["changed"] = was
    return Divergence("mismatch", root, [r for r in have if r != root], dict(have), evidence)


def _changed(have: dict[int, Point], ledgers: dict[int, Ledger], seq: int) -> tuple[int | None, str]:
    """The one rank whose element count at ``seq`` departs from what its own earlier calls from
    the same line had, and those counts in words; (None, "") unless exactly one rank changed."""
    counts = {r: p.numel for r, p in have.items() if p.numel > 0}
    before = {
        r: {p.numel for p in ledgers[r].points if p.site == have[r].site and p.seq < seq and p.numel > 0}
        for r in counts
    }
    changed = [r for r, n in counts.items() if before[r] and n not in before[r]]
    if len(changed) != 1:
        return None, ""
    root = changed[0]
    was = " or ".join(f"{n:,}" for n in sorted(before[root]))
    return root, f"rank {root}'s earlier calls from that line had {was} elements"


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
