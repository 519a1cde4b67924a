"""The hang patterns are a table (analysis/hung/patterns.py): the rows are the patterns the
docs list, in an order where a refinement stands above what it refines, and the first row that
applies names the hang."""

from __future__ import annotations

import re
from pathlib import Path

from ddpdoctor.analysis.hung.hang import analyse
from ddpdoctor.analysis.hung.patterns import PATTERNS, Look

DOCS = Path(__file__).resolve().parents[1] / "docs" / "hangs.md"


def _status(rank: int, name: str | None, op: str = "", seq: int = 5) -> dict:
    phase = {"name": name, "op": op, "seq": seq, "since_s": 40.0} if name else None
    return {"rank": rank, "pid": 1, "heartbeat_wall": 100.0, "phase": phase}


def test_every_row_is_a_documented_pattern_and_every_documented_pattern_a_row() -> None:
    documented = set(re.findall(r"^\| `(\w+)`(?: / `(\w+)`)?", DOCS.read_text(), re.MULTILINE))
    names = {n for pair in documented for n in pair if n}
    assert {p.name for p in PATTERNS} == names
    assert PATTERNS[-1].name == "backend_stuck", "the last row applies to every look"


def test_the_first_row_that_applies_names_the_hang() -> None:
    # A DDP forward on rank 0 against a barrier: rank_only_forward and collective_order both
    # apply; the refinement stands above and wins.
    statuses = {0: _status(0, "sync_buffers", "broadcast (eval)"), 1: _status(1, "collective", "barrier")}
    diag = analyse(statuses, {}, threshold_s=3)
    assert (diag.pattern, diag.culprits) == ("rank_only_forward", [0])
    states = {r: s for r, s in diag.ranks.items()}
    applies = [p.name for p in PATTERNS if p.blames(Look(states, None, False)) is not None]
    assert applies == ["rank_only_forward", "collective_order", "collective_mismatch", "backend_stuck"]


def test_ranks_in_collectives_of_different_groups_are_not_ordered_by_their_numbers() -> None:
    """Rank 0 in all_reduce #3 of a metrics group, rank 1 (a member) in the default group's
    gradient all-reduce #37 (held-out set 18: rank 1's except skipped the metrics sync). Each
    group numbers its own calls: no 'rank 1 already issued #3', no side guessed."""
    statuses = {0: _status(0, "collective", "all_reduce", 3), 1: _status(1, "backward", "allreduce", 37)}
    statuses[0]["phase"].update({"group": "1", "group_ranks": [0, 1]})
    statuses[1]["phase"]["group"] = "WORLD"
    diag = analyse(statuses, {}, threshold_s=3)
    assert (diag.pattern, diag.culprits) == ("groups_apart", [0, 1])
    said = diag.explanation
    assert "rank(s) 0 in all_reduce #3 of process group 1" in said and "of the default group" in said, said
    assert "rank(s) 1, member(s) of group 1, are not in its call" in said and "already issued" not in said
