"""Hangs, rank failures and startup failures on real torchrun jobs under `ddpdoctor run`."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import JOBS, diagnose_json, job_env, run_doctor, torchrun

pytestmark = pytest.mark.e2e
FAULTY = JOBS / "faulty_train.py"
EXIT_HANG_KILLED = 124
KILL = ("--hang-timeout", "3", "--on-hang", "kill")


def findings(run_dir: Path, kind: str) -> list[dict]:
    return [f for f in diagnose_json(run_dir)["findings"] if f["kind"] == kind]


def hang_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "hang-1" / "summary.json").read_text())


def onset_to_report_s(summary: dict) -> float:
    """Seconds from the moment the longest-waiting rank entered its sync point to the report."""
    onsets = [
        s["heartbeat_wall"] - s["phase"]["since_s"] for s in summary["statuses"].values() if s.get("phase")
    ]
    return summary["reported_wall"] - min(onsets)


def test_rank0_evaluation_through_the_wrapper_hangs_and_is_explained(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, FAULTY, "--mode", "eval0"), *KILL, timeout=120)
    assert job.returncode == EXIT_HANG_KILLED, job.stderr[-3000:]
    err = job.stderr
    assert "ddpdoctor: HANG - no progress for" in err
    assert "rank 0  in DistributedDataParallel.forward -> _sync_buffers (broadcast, collective #" in err
    assert "<- evaluate() faulty_train.py:" in err
    assert "rank 1  in dist.barrier() (collective #" in err
    assert "rank 0 runs a DDP forward the others never run" in err
    assert "Fix: evaluate model.module on rank 0" in err
    assert f"Stacks: {job.run_dir / 'hang-1'}" in err
    assert "done" not in job.stdout  # the job really was stopped, not finished
    summary = hang_summary(job.run_dir)
    assert onset_to_report_s(summary) <= 3 + 3, "diagnosis must follow within threshold + 3 s"
    assert (job.run_dir / "hang-1" / "stack-rank0.txt").read_text().count("_sync_buffers") >= 1
    [hang] = findings(job.run_dir, "hang")
    ranks = hang["details"]["ranks"]
    assert hang["ranks"] == [0] and hang["details"]["pattern"] == "rank_only_forward"
    assert ranks["0"]["phase"] == "sync_buffers" and ranks["1"]["op"] == "barrier"
    assert ranks["0"]["seq"] == ranks["1"]["seq"] >= 0
    assert ranks["0"]["user_frame"]["function"] == "evaluate"
    assert ranks["0"]["user_frame"]["file"].endswith("faulty_train.py")
    assert ranks["1"]["user_frame"]["function"] == "main"
    assert ranks["0"]["stack_method"] == "py-spy" and ranks["0"]["stack"]
    assert not findings(job.run_dir, "rank_failure"), "our own kill is not a rank failure"


def test_rank_that_skips_a_barrier(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, FAULTY, "--mode", "skip_barrier"), *KILL, timeout=120)
    assert job.returncode == EXIT_HANG_KILLED, job.stderr[-3000:]
    assert "skipped the barrier that rank(s) 0 wait in" in job.stderr
    [hang] = findings(job.run_dir, "hang")
    assert hang["details"]["pattern"] == "skipped_barrier" and hang["ranks"] == [1]
    ranks = hang["details"]["ranks"]
    assert (ranks["0"]["op"], ranks["1"]["op"]) == ("barrier", "all_reduce")


def test_rank_stuck_in_user_code_without_py_spy_uses_faulthandler(tmp_path: Path) -> None:
    # No py-spy: the stacks must come from the ranks' own faulthandler (SIGUSR1).
    job = run_doctor(
        tmp_path, torchrun(2, FAULTY, "--mode", "userloop"), *KILL, timeout=120, DDPDOCTOR_PYSPY="off"
    )
    assert job.returncode == EXIT_HANG_KILLED, job.stderr[-3000:]
    assert "rank 1 is stuck in user code at faulty_train.py" in job.stderr
    [hang] = findings(job.run_dir, "hang")
    r1 = hang["details"]["ranks"]["1"]
    assert hang["details"]["pattern"] == "user_code" and hang["ranks"] == [1]
    assert r1["stack_method"] == "faulthandler" and r1["user_frame"]["function"] == "spin_forever"
    assert hang["details"]["ranks"]["0"]["phase"] in ("sync_buffers", "backward", "collective")


@pytest.mark.parametrize("record", [False, True], ids=["plain", "with-@record"])
def test_rank_that_raises_is_the_first_failure(tmp_path: Path, record: bool) -> None:
    args = ("--mode", "raise") + (("--record",) if record else ())
    job = run_doctor(tmp_path, torchrun(2, FAULTY, *args), *KILL, timeout=120)
    assert job.returncode == 1, job.stderr[-3000:]  # torchrun's own code, passed through
    assert "HANG" not in job.stderr
    [failure] = findings(job.run_dir, "rank_failure")
    d = failure["details"]
    assert failure["ranks"] == [1] and d["first_rank"] == 1 and d["at_step"] == 3
    assert d["exception"]["type"] == "ValueError"
    assert "bad batch at step 3" in d["exception"]["traceback"]
    assert d["exception"]["frames"][-1][2] == "main"
    assert "0" in d["others"], "what rank 0 was doing when rank 1 failed"
    assert not findings(job.run_dir, "hang")


def test_rank_killed_by_sigkill(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, FAULTY, "--mode", "sigkill"), *KILL, timeout=120)
    assert job.returncode == 1, job.stderr[-3000:]
    [failure] = findings(job.run_dir, "rank_failure")
    d = failure["details"]
    assert failure["ranks"] == [1] and d["killed_by_signal"] is True and d["at_step"] == 3
    assert "killed by" in failure["summary"] and "exception" not in d
    assert "OOM" in failure["fix"]


def test_slow_steps_raise_no_false_alarm(tmp_path: Path) -> None:
    # Floor 2 s; rank 1 sleeps 1 s a step, then 2.5 s: rank 0 then waits about 2.5 s in a sync
    # point, over the floor, but under 5x the slowest step seen. A fixed 2 s threshold would fire.
    job = run_doctor(
        tmp_path,
        torchrun(2, FAULTY, "--mode", "slow", "--steps", "5", "--step-s", "1.0"),
        "--on-hang",
        "kill",
        timeout=120,
        DDPDOCTOR_HANG_FLOOR_S="2",
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert "HANG" not in job.stderr and not (job.run_dir / "hang-1").exists()
    assert "done" in job.stdout
    waits = []
    for line in (job.run_dir / "trace-rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec[0] in ("backward", "sync_buffers", "collective"):
            waits.append(rec[2] / 1e6)
    assert max(waits) > 2.0, "the job must have waited longer than the floor, or the test proves nothing"
    assert not findings(job.run_dir, "hang")


def test_ctrl_c_during_a_hang_still_writes_the_report(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpdoctor", "run", "--out", str(run_dir), "--hang-timeout", "2", "--"]
        + torchrun(2, FAULTY, "--mode", "eval0"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=job_env(),
    )
    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "hang-1" / "summary.json").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "no hang reported"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "HANG" in err and f"run dir: {run_dir}" in err
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "finished" and meta["signals_forwarded"] == ["SIGINT"]
    assert meta["hangs"] == 1
    assert findings(run_dir, "hang")


def test_master_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={port}",
            str(FAULTY),
        ]
        job = run_doctor(tmp_path, command, timeout=120)
    assert job.returncode != 0
    assert f"ddpdoctor: startup failed: master port {port} is already in use" in job.stderr
