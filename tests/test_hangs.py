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

from ddpdoctor import _env
from ddpdoctor.supervisor.stacks import pyspy_path
from tests.conftest import JOBS, diagnose_json, job_env, read_lines, run_doctor, torchrun

pytestmark = pytest.mark.e2e
FAULTY = JOBS / "faulty_train.py"
SLOW = JOBS / "slow_or_hung.py"
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
    assert "ddpdoctor: HANG - proven after" in err
    assert "disagree on the op of collective #" in err and "broadcast vs rank(s) 1 barrier" in err
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
    # One look cannot tell a skipped barrier from a rank-only call: the live verdict names both
    # sides; the ledger, which knows the lines each rank executed, says who skipped what.
    assert "(barrier vs all_reduce)" in job.stderr
    [hang] = findings(job.run_dir, "hang")
    assert hang["details"]["pattern"] == "collective_order" and hang["ranks"] == [0, 1]
    [cause] = findings(job.run_dir, "rank_only_collective")
    assert "rank(s) 1 skipped the barrier at faulty_train.py:69 that rank(s) 0 wait in" in cause["summary"]
    ranks = hang["details"]["ranks"]
    assert (ranks["0"]["op"], ranks["1"]["op"]) == ("barrier", "all_reduce")


def test_rank_stuck_in_user_code_without_py_spy_uses_faulthandler(tmp_path: Path) -> None:
    # No py-spy: the stacks must come from the ranks' own faulthandler (SIGUSR1).
    job = run_doctor(
        tmp_path, torchrun(2, FAULTY, "--mode", "userloop"), *KILL, timeout=120, DDPDOCTOR_PYSPY="off"
    )
    assert job.returncode == EXIT_HANG_KILLED, job.stderr[-3000:]
    # It spins (its CPU time advances): busy, not stuck, and a hang only because --hang-timeout ran out.
    assert "for a rank that is busy, not stuck" in job.stderr
    assert "rank 1 is busy in user code at faulty_train.py" in job.stderr
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
    # It raises after step 3's optimizer step, in no sync point: counted as step 4, before its
    # forward, as a raise at the top of the next iteration would be (they look alike).
    assert failure["ranks"] == [1] and d["first_rank"] == 1 and d["at_step"] == 4
    assert d["last_step_started"] == 3 and "step 3's backward had finished" in failure["summary"]
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
    assert failure["ranks"] == [1] and d["killed_by_signal"] is True and d["at_step"] == 4
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
    for rec in read_lines(job.run_dir / "trace-rank0.jsonl"):
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


def stall_to_verdict_s(summary: dict) -> float:
    """Seconds from the last rank's entry into the sync point it is stuck in to the verdict."""
    onsets = [
        s["heartbeat_wall"] - s["phase"]["since_s"] for s in summary["statuses"].values() if s.get("phase")
    ]
    return summary["detected_wall"] - max(onsets)


def test_proven_hang_is_declared_at_default_settings_within_3_s(tmp_path: Path) -> None:
    # No --hang-timeout: the auto threshold is 30 s, but the statuses prove the hang at once.
    job = run_doctor(tmp_path, torchrun(2, FAULTY, "--mode", "eval0"), "--on-hang", "kill", timeout=120)
    assert job.returncode == EXIT_HANG_KILLED, job.stderr[-3000:]
    summary = hang_summary(job.run_dir)
    assert summary["verdict"]["state"] == "proven" and summary["threshold_s"] >= 30
    assert stall_to_verdict_s(summary) <= 3.0, summary["verdict"]
    [hang] = findings(job.run_dir, "hang")
    assert "disagree on the op of collective" in hang["details"]["proof"]


def test_rank_that_exits_0_early_is_named_not_its_waiting_peer(tmp_path: Path) -> None:
    # Rank 1 returns (exit 0) before the all_reduce rank 0 waits in. gloo sees the closed socket
    # and rank 0 raises "Connection closed by peer"; a backend that keeps waiting (NCCL) leaves
    # rank 0 blocked, which the proof catches at once. Either way rank 1 is the cause.
    job = run_doctor(tmp_path, torchrun(2, SLOW, "--mode", "early_exit"), "--on-hang", "kill", timeout=120)
    assert job.returncode in (1, EXIT_HANG_KILLED), job.stderr[-3000:]
    exits = json.loads((job.run_dir / "watch.json").read_text())["rank_exits"]
    assert exits["1"]["exited"] is True, "rank 1 said it left on its own"
    if job.returncode == EXIT_HANG_KILLED:
        [hang] = findings(job.run_dir, "hang")
        assert hang["ranks"] == [1] and "rank 1 exited" in hang["details"]["proof"]
    else:
        # The cause is rank 1's departure (the offline ledger names it); rank 0's error is folded in.
        errors = [f for f in diagnose_json(job.run_dir)["findings"] if f["severity"] == "error"]
        assert errors and all(f["ranks"] == [1] for f in errors), [f["summary"] for f in errors]
        assert "HANG" not in job.stderr


@pytest.mark.parametrize("mode", ["slow_eval", "slow_ckpt"])
def test_rank0_only_slow_work_is_not_a_hang(tmp_path: Path, mode: str) -> None:
    # Floor 4 s (CI's stand-in for the 30 s default); rank 0 works 12 s while rank 1 waits in a
    # barrier: three times the threshold, and still no hang, because rank 0 progresses.
    job = run_doctor(
        tmp_path,
        torchrun(2, SLOW, "--mode", mode, "--busy-s", "12"),
        timeout=180,
        DDPDOCTOR_HANG_FLOOR_S="4",
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert "HANG" not in job.stderr and not (job.run_dir / "hang-1").exists()
    assert "ddpdoctor: not a hang: rank(s) 1 wait in barrier #" in job.stderr
    assert "ERROR hang" not in job.stderr and not findings(job.run_dir, "hang")
    [work] = findings(job.run_dir, "rank_only_work")
    function = "evaluate" if mode == "slow_eval" else "save_checkpoint"
    assert work["ranks"] == [0] and work["details"]["waiting"] == [1]
    assert work["details"]["where"].startswith(f"{function}() slow_or_hung.py:")
    assert 11.0 <= work["details"]["idle_s"]["1"] <= 30.0, "the barrier's own duration on rank 1"
    assert not (job.run_dir / "waiting.json").exists(), "the live note goes when the wait ends"


def test_a_hang_given_live_becomes_an_efficiency_finding_when_the_job_completes(tmp_path: Path) -> None:
    # --hang-timeout 3 makes the busy wait a hang live; the job then completes with exit 0.
    job = run_doctor(
        tmp_path,
        torchrun(2, SLOW, "--mode", "slow_eval", "--busy-s", "8"),
        "--hang-timeout",
        "3",
        timeout=180,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert "ddpdoctor: HANG" in job.stderr, "the live verdict was printed"
    assert (job.run_dir / "hang-1" / "summary.json").exists(), "and stays in the run dir"
    assert "ERROR hang" not in job.stderr and not findings(job.run_dir, "hang")
    [work] = findings(job.run_dir, "rank_only_work")
    assert "reported live as a hang; the job then completed" in work["summary"]
    assert work["details"]["live_verdicts"][0]["hang_dir"].endswith("hang-1")
    assert work["details"]["idle_s"]["1"] >= 7.0


def test_a_rank_that_sleeps_outside_sync_points_is_a_stall_at_the_threshold(tmp_path: Path) -> None:
    job = run_doctor(
        tmp_path,
        torchrun(2, SLOW, "--mode", "sleep"),
        "--on-hang",
        "kill",
        timeout=180,
        DDPDOCTOR_HANG_FLOOR_S="5",
    )
    assert job.returncode == EXIT_HANG_KILLED, job.stderr[-3000:]
    summary = hang_summary(job.run_dir)
    assert summary["verdict"]["state"] == "stalled" and summary["verdict"]["culprits"] == [0]
    assert 5.0 <= stall_to_verdict_s(summary) <= 5.0 + 4.0
    [hang] = findings(job.run_dir, "hang")
    assert hang["details"]["ranks"]["0"]["user_frame"]["function"] == "wait_for_peer"


def test_a_rank_blocked_in_its_own_backward_code_is_named_not_the_all_reduce(
    tmp_path: Path, native_timer: Path
) -> None:
    # Rank 0 sleeps in a custom autograd Function's backward after its first gradient bucket
    # was reduced; rank 1 waits for the next bucket. Both statuses say "backward, #14": only
    # rank 0's stack (its own code inside the pass, CPU idle) says which one the other awaits.
    job = run_doctor(
        tmp_path,
        torchrun(2, SLOW, "--mode", "backward_sleep"),
        "--on-hang",
        "kill",
        DDPDOCTOR_HANG_FLOOR_S="5",
        # Its 1.09 MB of gradients sit just past auto's 1 MiB line, where each rank's measured pass
        # decides: this test reads the timer's bucket records, so it asks for them.
        DDPDOCTOR_BUCKET_TIMING="on",
    )
    assert job.returncode == EXIT_HANG_KILLED, job.stderr[-3000:]
    verdict = hang_summary(job.run_dir)["verdict"]
    assert verdict["state"] == "stalled" and verdict["culprits"] == [0], verdict
    assert "in its own code inside its DDP backward (wait_for_peer()" in verdict["proof"]
    [hang] = findings(job.run_dir, "hang")
    assert hang["ranks"] == [0] and hang["summary"].startswith("Rank(s) 0 never finished its DDP backward")
    assert "wait for it in the gradient all-reduce (from collective #" in hang["summary"]
    assert hang["details"]["ranks"]["0"]["user_frame"]["function"] == "wait_for_peer"
    assert hang["fix"].startswith("Find what wait_for_peer() at slow_or_hung.py:")
    for rank in (0, 1):
        # The bucket both reduced in the step that hung reached the trace from the writer thread
        # (the C++ timer's notes; the backward that would have packed them never ended).
        records = read_lines(job.run_dir / f"trace-rank{rank}.jsonl")
        last = max(r[3] for r in records if r[0] == "backward")
        hung = [r for r in records if r[0] == "allreduce" and r[3] == last + 1]
        assert [r[4] for r in hung] == [0], hung
    # Where they parted: the bucket after the one both reduced, which rank 0 never issued.
    view = diagnose_json(job.run_dir)["failure"]
    parting = view["parting"]
    assert parting["seq"] == hung[0][6] + 1
    row = parting["rows"][str(parting["seq"])]
    assert row["0"] is None and row["1"]["op"] == "gradient all-reduce" and row["1"]["in_flight"]
    spans = {(s["rank"], s["kind"]): s for s in view["open_spans"]}
    assert set(spans) == {(0, "backward"), (1, "backward"), (1, "allreduce")}, "rank 0: no all-reduce open"
    assert spans[(1, "allreduce")]["label"] == f"gradient all-reduce #{parting['seq']}"


def test_a_new_group_only_rank0_creates_is_proven_against_the_ddp_constructor(
    tmp_path: Path, write_script
) -> None:
    # Rank 0 creates a group the others never create (a collective of the default group) and
    # rank 1 goes on to construct DDP, itself a collective: both wait, and the new_group's rank
    # is named, not rank 1 "busy in user code" (live, the proof comes once rank 1's constructor
    # has stopped computing; the statuses name both sync points whichever verdict came first).
    script = write_script(
        "partial_group.py",
        """
        import torch.distributed as dist
        import torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            group = dist.new_group([0, 1])
        model = DDP(nn.Linear(4, 2))
        dist.destroy_process_group()
        """,
    )
    job = run_doctor(tmp_path, torchrun(2, script), "--hang-timeout", "6", "--on-hang", "kill", timeout=120)
    assert job.returncode == EXIT_HANG_KILLED, job.stderr[-3000:]
    assert "rank 1  in DistributedDataParallel.__init__" in job.stderr, job.stderr[-3000:]
    found = {f["kind"]: f for f in diagnose_json(job.run_dir)["findings"] if f["severity"] == "error"}
    cause = found["rank_only_collective"]
    assert cause["ranks"] == [0] and cause["details"]["place"] == "partial_group.py:8"
    assert "new_group(...) on every rank" in cause["fix"]


@pytest.mark.parametrize("pyspy", ["as installed", "slow"])
def test_setup_before_the_ddp_constructor_is_a_one_time_wait_not_a_warning(
    tmp_path: Path, write_script, pyspy: str
) -> None:
    # Rank 0 prepares data before wrapping the model; rank 1 waits in DDP's constructor (a
    # collective of its group): a wait on a busy rank, charged once before step 0 as an info.
    # "slow": each py-spy sample takes a second, as on a loaded host (CI saw it). The watcher
    # used to back off five times a look's wall time, dump included, and went blind past the
    # 3 s threshold with rank 0 not yet measured: the clock called a busy rank a hang.
    env = {_env.HANG_FLOOR: "3"}
    if pyspy == "slow":
        real = pyspy_path()
        assert real is not None, "py-spy is a dependency"
        wrapper = tmp_path / "slow-py-spy"
        wrapper.write_text(f'#!/bin/sh\nsleep 1\nexec {real} "$@"\n')
        wrapper.chmod(0o755)
        env[_env.PYSPY] = str(wrapper)
    script = write_script(
        "prepare_then_wrap.py",
        """
        import time

        import torch
        import torch.distributed as dist
        import torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP


        def prepare_dataset() -> None:
            end = time.monotonic() + 6
            while time.monotonic() < end:
                sum(range(10_000))


        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            prepare_dataset()
        model = DDP(nn.Linear(4, 2))
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
        dist.destroy_process_group()
        """,
    )
    job = run_doctor(tmp_path, torchrun(2, script), timeout=120, **env)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "HANG" not in job.stderr, job.stderr
    found = diagnose_json(job.run_dir)["findings"]
    assert not [f for f in found if f["severity"] != "info"], [f["summary"] for f in found]
    [work] = [f for f in found if f["kind"] == "rank_only_work"]
    assert work["ranks"] == [0] and "at DDP constructor #0" in work["summary"], work["summary"]
    assert work["summary"].startswith("one-time setup before step 0")
