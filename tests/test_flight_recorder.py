"""The Flight Recorder: on in the ranks, dumped on a hang, merged into the hang finding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.hung import flight
from ddpdoctor.probes import flight_recorder
from ddpdoctor.rundir import RunDir
from ddpdoctor.supervisor.launch import job_environment
from tests.conftest import JOBS, diagnose_json, run_doctor, torchrun


def entry(seq: int, op: str, state: str, retired: bool, sizes=None) -> dict:
    return {
        "collective_seq_id": seq,
        "record_id": seq - 1,
        "profiling_name": op,
        "state": state,
        "retired": retired,
        "input_sizes": sizes or [],
        "input_dtypes": ["Float"],
        "is_p2p": False,
        "process_group": ["0", "default_pg"],
    }


def test_summary_uses_state_on_nccl_and_retired_on_gloo() -> None:
    nccl = {
        "entries": [
            entry(1, "nccl:all_reduce", "completed", True, [[10]]),
            entry(2, "nccl:all_reduce", "completed", False, [[10]]),  # done on the device
            entry(3, "nccl:broadcast", "started", False, [[64]]),
            entry(4, "nccl:broadcast", "scheduled", False, [[1]]),
        ]
    }
    s = flight.summarise(nccl)
    # In ddpdoctor's numbering (the count before it began): the Flight Recorder's id minus 1.
    assert (s["last_completed"]["seq"], s["last_completed"]["op"]) == (1, "all_reduce")
    assert s["first_pending"] == {
        "seq": 2,
        "fr_seq": 3,
        "op": "broadcast",
        "sizes": [[64]],
        "dtypes": ["Float"],
        "group": "default_pg",
        "state": "started",
        "p2p": False,
    }
    gloo = {
        "entries": [entry(1, "gloo:barrier", "scheduled", True), entry(2, "gloo:barrier", "scheduled", False)]
    }
    s = flight.summarise(gloo)
    assert s["last_completed"]["seq"] == 0 and s["first_pending"]["seq"] == 1
    assert flight.summarise({"entries": []}) == {"last_completed": None, "first_pending": None, "entries": 0}


def test_environment_turns_it_on_unless_the_user_chose(tmp_path: Path) -> None:
    env = job_environment(tmp_path, {})
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_ENABLE_TIMING"] == "1"
    env = job_environment(tmp_path, {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_ENABLE_TIMING": "0"})
    assert env["TORCH_FR_BUFFER_SIZE"] == "0" and env["TORCH_NCCL_ENABLE_TIMING"] == "0"


def test_no_wait_when_the_flight_recorder_is_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    (tmp_path / "hang-1").mkdir()
    assert flight.on_hang(tmp_path, tmp_path / "hang-1", {0: {}}, timeout_s=30) == ""
    assert not (tmp_path / RunDir.FR_REQUEST).exists()


def test_rank_side_answers_each_request_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flight_recorder, "dump_json", lambda: b'{"entries": []}')
    w = flight_recorder._Watcher(str(tmp_path), 3, on_error=None)
    assert w.serve() is None  # no request yet
    (tmp_path / "hang-1").mkdir()
    (tmp_path / RunDir.FR_REQUEST).write_text(json.dumps({"id": 1, "dir": "hang-1"}))
    assert w.serve() == tmp_path / "hang-1" / "fr-rank3.json"
    assert w.serve() is None  # the same request again: already answered
    (tmp_path / RunDir.FR_REQUEST).write_text(json.dumps({"id": 2, "dir": "../elsewhere"}))
    assert w.serve() is None  # never outside the run directory


def test_merge_adds_each_ranks_state_to_the_finding(tmp_path: Path) -> None:
    dump = {
        "entries": [
            entry(1, "gloo:all_reduce", "scheduled", True, [[4]]),
            entry(2, "gloo:broadcast", "scheduled", False),
        ]
    }
    (tmp_path / "fr-rank0.json").write_text(json.dumps(dump))
    f = flight.merge(Finding("hang", "error", [0], "Ranks disagree.", details={"ranks": {"0": {}}}), tmp_path)
    assert f.details["ranks"]["0"]["flight_recorder"]["first_pending"]["op"] == "broadcast"
    assert "rank 0: last completed all_reduce #0 [[4]], first not completed broadcast #1" in f.summary
    untouched = Finding("hang", "error", [0], "x")
    assert flight.merge(untouched, tmp_path / "absent").summary == "x"


@pytest.mark.e2e
def test_rank0_evaluation_hang_names_each_ranks_pending_collective(tmp_path: Path) -> None:
    """Real gloo job: rank 0 evaluates through the wrapper (buffer broadcast) while rank 1
    waits in a barrier. The ranks dump their Flight Recorder entries when the hang is caught."""
    job = run_doctor(
        tmp_path,
        torchrun(2, JOBS / "faulty_train.py", "--mode", "eval0"),
        "--hang-timeout",
        "3",
        "--on-hang",
        "kill",
        timeout=120,
    )
    assert job.returncode == 124, job.stderr[-3000:]
    hang_dir = job.run_dir / "hang-1"
    assert (hang_dir / "fr-rank0.json").exists() and (hang_dir / "fr-rank1.json").exists()
    assert "Flight Recorder (collectives the process group finished):" in job.stderr
    [hang] = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "hang"]
    fr = hang["details"]["flight_recorder"]
    r0, r1 = fr["0"], fr["1"]
    assert r0["first_pending"]["op"] == "broadcast" and r1["first_pending"]["op"] == "barrier"
    assert r0["first_pending"]["seq"] == r1["first_pending"]["seq"]  # same slot, different ops
    assert r0["last_completed"]["seq"] == r1["last_completed"]["seq"] == r0["first_pending"]["seq"] - 1
    assert r0["last_completed"]["op"] == r1["last_completed"]["op"] == "all_reduce"
    assert r0["first_pending"]["sizes"] and r0["first_pending"]["sizes"][0]  # the buffer's shape
    assert "first not completed broadcast #" in hang["summary"]
    assert hang["details"]["proof"] and hang["details"]["flight_recorder_confirms"] is True
    assert "The Flight Recorder confirms the proof" in hang["summary"]
    assert hang["details"]["ranks"]["0"]["user_frame"]["function"] == "evaluate"  # stacks kept


def _fr(op: str | None, seq: int = 5, sizes: list | None = None, done: int = 4) -> dict:
    last = {"op": "all_reduce", "seq": done, "sizes": [[4]]}
    return {"last_completed": last, "first_pending": op and {"op": op, "seq": seq, "sizes": sizes}}


def test_the_flight_recorder_confirms_where_the_ranks_parted() -> None:
    from ddpdoctor.analysis.hung.flight import parting

    assert "rank 0 broadcast #5" in parting({0: _fr("broadcast"), 1: _fr("barrier")})
    assert parting({0: _fr("all_reduce", sizes=[[4]]), 1: _fr("all_reduce", sizes=[[8]])})
    assert "rank 1 all_reduce #6" in parting({0: _fr("all_reduce"), 1: _fr("all_reduce", seq=6)})
    assert "rank(s) 1 have no unfinished" in parting({0: _fr("all_reduce"), 1: _fr(None)})
    # Every rank in the same collective, or none waiting: the records show no parting.
    assert parting({0: _fr("all_reduce", sizes=[[4]]), 1: _fr("all_reduce", sizes=[[4]])}) is None
    assert parting({0: _fr(None), 1: _fr(None)}) is None


def test_merge_says_when_the_flight_recorder_does_not_back_the_proof(tmp_path: Path) -> None:
    entry = {"profiling_name": "gloo:all_reduce", "collective_seq_id": 5, "input_sizes": [[4]]}
    for rank in (0, 1):
        (tmp_path / f"fr-rank{rank}.json").write_text(json.dumps({"entries": [entry]}))
    proven = Finding("hang", "error", [0], "x", details={"proof": "ranks disagree on the op of #5"})
    f = flight.merge(proven, tmp_path)
    assert f.details["flight_recorder_confirms"] is False
    assert "does not show the ranks parting" in f.summary
    busy = Finding("hang", "error", [0], "x", details={"proof": "busy: rank 0 evaluates"})
    assert "flight_recorder_confirms" not in flight.merge(busy, tmp_path).details
