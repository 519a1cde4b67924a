"""Two parts of the failure view that read like the terminal: stacks and the parting point.

* The stacks of every rank, grouped by identical stack (ranks that stand in the same place are
  one group, as the terminal's hang report groups ranks by where they wait), with ddpdoctor's
  own frames and threads left out, as ``file:line function`` lines, innermost first.
* The collectives around the point where the ranks parted: the ledgers' first divergence
  (``parting.first_divergence``), else the first sequence number not every rank completed, as a
  small table of sequence number by rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddpdoctor.analysis.failed.parting import first_divergence
from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE, Ledger, Point
from ddpdoctor.analysis.hung.hang import group_ranks
from ddpdoctor.trace import schema
from ddpdoctor.trace.livephase import LivePhase
from ddpdoctor.trace.stacktext import is_doctor_frame, is_user_frame

if TYPE_CHECKING:
    from ddpdoctor.analysis.failed.failure_spans import OpenSpan

AROUND = 3  # sequence numbers shown before the parting point
_MARKERS = ("site-packages" + os.sep, "dist-packages" + os.sep)

# An open span's op ("allreduce", "broadcast") as the ledger names DDP's own sync points.
_DDP_LABELS = {p.op: p.label for p in (LivePhase.BACKWARD, LivePhase.SYNC_BUFFERS)}


@dataclass
class StackGroup:
    """Ranks whose main thread stood in the same stack."""

    ranks: list[int]
    where: str  # the sync point they were in ("barrier #24"), or "user code"
    frames: list[str]  # "file:line function", innermost first, ddpdoctor's frames left out
    user: int  # index in ``frames`` of the innermost user frame (-1: none)


def short_file(path: str) -> str:
    """A file as a reader finds it: from the package for installed code, else its last two parts."""
    for marker in _MARKERS:
        if marker in path:
            return path.split(marker, 1)[1]
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) if len(parts) > 1 else path


def stack_groups(stacks: dict[int, list[dict[str, Any]]], where: dict[int, str]) -> list[StackGroup]:
    """Group ranks by identical stack (frames innermost first, ddpdoctor's own left out)."""
    keys: dict[int, tuple[str, tuple[str, ...]]] = {}
    users: dict[tuple[str, tuple[str, ...]], int] = {}
    for rank, frames in stacks.items():
        kept = [f for f in frames if not is_doctor_frame(str(f.get("file", "")))]
        lines = tuple(f"{short_file(str(f.get('file')))}:{f.get('line')} {f.get('function')}" for f in kept)
        keys[rank] = (where.get(rank, ""), lines)
        users[keys[rank]] = next((i for i, f in enumerate(kept) if is_user_frame(str(f.get("file", "")))), -1)
    return [StackGroup(ranks, w, list(lines), users[(w, lines)]) for ranks, (w, lines) in group_ranks(keys)]


def _cell(point: Point, in_flight: bool) -> dict[str, Any]:
    return {
        "op": point.op,
        "bytes": point.nbytes or None,
        "site": point.site,
        "step": point.step,
        "in_flight": in_flight or point.in_flight or point.raised,
    }


def _next_point(
    by_seq: dict[int, dict[int, dict[str, Any]]], present: list[int], spans: list[OpenSpan]
) -> int:
    """Every rank completed every collective on record: the ranks parted at the next one, which
    the ranks inside a sync point (that the trace could not number) entered and the others never
    issued. Returns its number, with its row filled in; the last number when no rank was inside."""
    last = max(by_seq)
    inside = {
        s.rank: s
        for s in spans
        if s.seq is None
        and s.kind in (schema.BACKWARD, schema.ALLREDUCE, schema.COLLECTIVE, schema.SYNC_BUFFERS)
    }
    if not inside:
        return last
    row = by_seq.setdefault(last + 1, {})
    for rank, span in inside.items():
        op = GRAD_ALLREDUCE if span.kind in (schema.BACKWARD, schema.ALLREDUCE) else span.label
        row[rank] = _cell(Point(last + 1, op, 0, "WORLD", span.step, span.user_frame), True)
    return last + 1


def parting_table(books: dict[int, Ledger], open_spans: list[OpenSpan]) -> dict[str, Any]:
    """The collectives (default group) around where the ranks parted: ``{"seq": the parting
    sequence number, "seqs": [...], "rows": {seq: {rank: cell or None}}}`` where a cell is
    ``{op, bytes, site, step, in_flight}`` (in_flight: the rank entered it and never left; a
    rank's sync point that the trace could not number counts as the next number after the last
    collective every rank completed)."""
    by_seq: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, book in books.items():
        for p in book.points:
            if p.group == "WORLD" and p.seq >= 0:
                by_seq.setdefault(p.seq, {})[rank] = _cell(p, False)
    for span in open_spans:  # a sync point the trace never recorded (the rank never left it)
        if span.seq is not None and span.seq >= 0 and span.op:
            op = _DDP_LABELS.get(span.op, span.op)
            cells = by_seq.setdefault(span.seq, {})
            cells[span.rank] = _cell(Point(span.seq, op, 0, "WORLD", span.step, span.user_frame), True)
    if not by_seq:
        return {}
    present = [r for r, b in books.items() if b.ending.how != "never_started"]
    divergence = first_divergence(books)
    if divergence is not None and isinstance(divergence.evidence.get("seq"), int):
        parting = int(divergence.evidence["seq"])
    else:
        partial = [
            s
            for s, cells in by_seq.items()
            if len(cells) < len(present) or any(c["in_flight"] for c in cells.values())
        ]
        parting = min(partial) if partial else _next_point(by_seq, present, open_spans)
    seqs = [s for s in sorted(by_seq) if parting - AROUND <= s <= parting + 1]
    rows = {str(s): {str(r): by_seq[s].get(r) for r in sorted(present)} for s in seqs}
    return {"seq": parting, "seqs": seqs, "rows": rows}
