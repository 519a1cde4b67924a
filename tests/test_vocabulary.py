"""The trace vocabulary: a kind declared once reaches the reader, the phase table, the HTML
timeline and the Perfetto export with no other edit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpdoctor.analysis import diagnose
from ddpdoctor.analysis.slow.phases import rank_phases
from ddpdoctor.reports import chrome, html
from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import load_run, read_trace
from ddpdoctor.trace.synthetic import SyntheticJob, append_records, write_run

# Short and long names on purpose: names of any length are declared in the file's layout.
KINDS = ("ckpt", "checkpoint_shard_write")


@pytest.fixture
def declared() -> Iterator[None]:
    before = dict(schema.KINDS), dict(schema.PHASES)
    for i, name in enumerate(KINDS):
        schema.declare(
            schema.EventKind(name, ("shard", "path"), "is", "write shard {shard}"),
            schema.Phase(name, name, f"checkpoint {i}", schema.Lane.COMM, "#123456"),
        )
    yield
    schema.KINDS.clear(), schema.KINDS.update(before[0])
    schema.PHASES.clear(), schema.PHASES.update(before[1])


def _append(run_dir: Path, rank: int) -> None:
    records = [[k, 1000 * step + 50, 200, step, step, f"/ckpt/{step}.pt"] for k in KINDS for step in range(3)]
    append_records(RunDir(run_dir).trace(rank), records)


def test_a_declared_kind_flows_to_the_report_and_the_export(tmp_path: Path, declared: None) -> None:
    (run_dir,) = write_run(SyntheticJob(ranks=2, steps=3), tmp_path / "run")
    for rank in (0, 1):
        _append(run_dir, rank)

    trace = read_trace(RunDir(run_dir).trace(0))
    for name in KINDS:
        ev = trace.kind(name)
        assert len(ev) == 3 and ev.step.tolist() == [0, 1, 2]
        assert list(ev.fields) == [(s, f"/ckpt/{s}.pt") for s in range(3)]
        assert rank_phases(trace)[name]["count"] == 3
    assert trace.skipped_lines == 0

    diag = diagnose(load_run([run_dir]))
    page = html.render(diag)
    for i in range(len(KINDS)):
        assert f"checkpoint {i}" in page  # the legend entry and the phase table's column

    events = chrome.document(diag)["traceEvents"]
    mine = [e for e in events if e.get("cat") in KINDS]
    assert len(mine) == 2 * len(KINDS) * 3
    assert {e["name"] for e in mine} == {"write shard 0", "write shard 1", "write shard 2"}
    assert all(e["tid"] >= chrome.COMM_TID for e in mine)  # declared on the comm lane
    assert {e["args"]["path"] for e in mine} == {f"/ckpt/{s}.pt" for s in range(3)}


def test_a_spec_must_match_the_fields() -> None:
    with pytest.raises(ValueError, match="spec"):
        schema.EventKind("bad", ("a", "b"), "i")


def test_every_phase_reads_a_declared_kind() -> None:
    for phase in schema.PHASES.values():
        assert phase.kind in schema.KINDS
    assert not set(schema.KINDS) & schema.META_KINDS
