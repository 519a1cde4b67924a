"""A live phase is one declaration (trace/schema.py LivePhase): every reader of a status' phase
(the proof, the hang text, the ledger, the failure view's spans, attach) takes its label, op,
way of waiting and spans from the member, so each member is understood everywhere."""

from __future__ import annotations

import pytest

from ddpdoctor.analysis.failed.failure_spans import _from_phase
from ddpdoctor.analysis.hung.hang import describe_phase
from ddpdoctor.analysis.hung.proof import ATOMIC, COMPOUND, SYNC, op_label, point
from ddpdoctor.trace.livephase import SYNC_LIVE_PHASES, LivePhase


@pytest.mark.parametrize("live", list(LivePhase))
def test_every_live_phase_is_read_from_its_declaration(live: LivePhase) -> None:
    phase = {**live.status(), "seq": 7, "since_s": 2.0}
    if live is LivePhase.COLLECTIVE:
        phase["op"] = "all_gather"
    assert phase["name"] == live.value and LivePhase.of(live.value) is live
    where = describe_phase(phase, [])
    assert where and "{" not in where and ("#7" in where or not live.waits_for_peers)
    assert op_label(phase) == (live.op or live.label or phase["op"])
    # The failure view draws the spans the member declares, in its lanes.
    spans = _from_phase(0, phase, 0.0, 1.0, 3, "", "")
    assert [(s.kind, s.lane) for s in spans] == list(live.spans)
    if live.waits_for_peers:
        assert live.value in SYNC and "#7" in point(phase)
    assert (live.value in ATOMIC, live.value in COMPOUND) == (
        live.waits == "atomic",
        live.waits == "compound",
    )


def test_the_sync_phases_are_the_ones_that_wait_for_peers() -> None:
    assert SYNC == SYNC_LIVE_PHASES == ATOMIC | COMPOUND
    assert LivePhase.DATA.value not in SYNC_LIVE_PHASES and LivePhase.of("no such phase") is None


def test_ddp_own_sync_points_have_one_op_and_one_label_each() -> None:
    backward = {**LivePhase.BACKWARD.status(), "seq": 4}
    buffers = {**LivePhase.SYNC_BUFFERS.status(), "seq": 4}
    assert (op_label(backward), op_label(buffers)) == ("allreduce", "broadcast")
    assert (
        point(buffers) == "broadcast #4 (DDP buffers)" and point(backward) == "allreduce #4.. (DDP backward)"
    )
    assert [s.label for s in _from_phase(0, backward, 0.0, 1.0, 3, "", "")] == [
        "backward",
        "gradient all-reduce #4",
    ]
