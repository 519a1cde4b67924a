"""`ddpdoctor export`: Chrome trace JSON that loads back with the structure Perfetto expects."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import JOBS, run_doctor, torchrun
from test_reports import doctor

from ddpdoctor import reports
from ddpdoctor.analysis import diagnose
from ddpdoctor.reports import chrome
from ddpdoctor.trace.reader import load_run
from ddpdoctor.trace.synthetic import SyntheticJob, write_run


def check_structure(
    trace: dict, ranks: list[int], hosts: dict[int, str]
) -> dict[tuple[int, int], list[dict]]:
    """Assert the trace's shape; return its X events by (pid, tid)."""
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {r: f"rank {r} ({hosts[r]})" for r in ranks}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    by_thread: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert {"name", "cat", "ts", "dur", "pid", "tid", "args"} <= set(e)
            assert isinstance(e["ts"], int) and e["dur"] >= 0
            assert (e["pid"], e["tid"]) in threads, "every thread is named"
            by_thread[(e["pid"], e["tid"])].append(e)
    for r in ranks:
        assert threads[(r, chrome.COMPUTE_TID)] == "compute"
        assert threads[(r, chrome.COMM_TID)] == "comm"
    for key, evs in by_thread.items():  # complete events nest on every thread
        stack: list[int] = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1], (key, e)
            stack.append(e["ts"] + e["dur"])
    return by_thread


def test_synthetic_export_structure_and_lanes(tmp_path: Path) -> None:
    dirs = write_run(SyntheticJob(ranks=4, steps=5, ranks_per_host=2, buckets=4), tmp_path / "runs")
    diag = diagnose(load_run(dirs))
    path = reports.write(diag, tmp_path / "t.json")
    trace = json.loads(path.read_text())
    by_thread = check_structure(trace, [0, 1, 2, 3], {r: f"node{r // 2}" for r in range(4)})
    comm = [e for (pid, tid), evs in by_thread.items() if tid >= chrome.COMM_TID for e in evs]
    compute = [e for (pid, tid), evs in by_thread.items() if tid < chrome.COMM_TID for e in evs]
    assert {e["cat"] for e in comm} == {"allreduce"}
    assert {"forward", "backward", "optimizer", "data_wait"} <= {e["cat"] for e in compute}
    assert len(comm) == 4 * 5 * 4
    # The synthetic buckets overlap, so more than one comm lane is needed, all named "comm ...".
    assert any(tid > chrome.COMM_TID for (_, tid) in by_thread)
    params = next(e for e in comm if e["args"]["bucket"] == 1)["args"]["params"]
    assert params == ["layers.2.weight", "layers.3.weight"]
    assert not [e for e in trace["traceEvents"] if e["ph"] == "C"]  # counters come from NVML files only


@pytest.mark.e2e
def test_export_of_a_real_run(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, JOBS / "counted_train.py"), DDPDOCTOR_BUCKET_TIMING="on")
    assert job.returncode == 0, job.stderr
    out = tmp_path / "trace.json"
    proc = doctor("export", str(job.run_dir), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(out.read_text())
    host = load_run([job.run_dir]).ranks[0].host
    by_thread = check_structure(trace, [0, 1], {0: host, 1: host})
    for rank in (0, 1):
        cats = [e["cat"] for (pid, _), evs in by_thread.items() if pid == rank for e in evs]
        assert cats.count("backward") == 24  # counted_train: 24 training steps
        assert cats.count("forward") == 24 + 2 * 3  # plus 2 eval forwards per epoch
        assert cats.count("allreduce") >= 24
        assert [
            e["name"]
            for e in trace["traceEvents"]
            if e.get("pid") == rank and e["ph"] == "X" and e["cat"] == "collective"
        ].count("barrier") == 4
