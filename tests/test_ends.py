"""When the supervisor says a rank ended (supervisor/ends.py), from its own records."""

from __future__ import annotations

from pathlib import Path

from test_trace import header

from ddpdoctor.supervisor.ends import rank_ends
from ddpdoctor.trace import schema
from ddpdoctor.trace.writer import TraceWriter

MONO, WALL = 5_000_000_000, 1_700_000_000_000_000_000  # test_trace.header's clock anchors
S = 1_000_000_000


def _trace(run_dir: Path, rank: int, *records: tuple) -> None:
    """A rank's trace that ends without a word (no ``end`` record: SIGKILL)."""
    w = TraceWriter(str(run_dir / f"trace-rank{rank}.bin"), header(rank), flush_interval=60)
    for record in records:
        w.put(record)
    w.flush()
    w._stop.set()


def test_a_rank_killed_after_its_backward_raised_ended_after_the_raise(tmp_path: Path) -> None:
    """Rank 0 raised at 1.5 s and left; rank 1's gradient all-reduce waited for it from 1.0 s,
    raised at 2.8 s, and the rank was SIGKILLed with no word. Its last event (1.0 s) is not when
    it died: its ``raised`` record, a span, says it was alive at 2.8 s. So rank 0 failed first."""
    error = {
        "thread": "MainThread",
        "type": "RuntimeError",
        "message": "gives up",
        "wall_ns": WALL + 3 * S // 2,
    }
    _trace(
        tmp_path,
        0,
        (schema.FORWARD, MONO + S // 2, MONO + S // 2 + 1000, 5, 1, 1, 10, 1),
        (schema.RANK_ERROR, MONO + 3 * S // 2, MONO + 3 * S // 2, 5, error),
    )
    raised = {"kind": schema.BACKWARD, "fields": [0], "dur_us": 1_800_000}
    _trace(
        tmp_path,
        1,
        (schema.FORWARD, MONO + S - 1000, MONO + S, 6, 1, 1, 11, 1),
        (schema.RAISED, MONO + S, MONO + S + 1_800_000_000, 6, raised),
    )
    ends, first = rank_ends(tmp_path)
    assert (ends["1"]["how"], ends["1"]["signal"]) == ("signal", "SIGKILL"), ends["1"]
    assert ends["1"]["at_wall"] == (WALL + 2_800_000_000) / 1e9, ends["1"]
    assert first == 0, ends
