"""`attach` and `top` on real 2-rank torchrun jobs (gloo on CPU), one started without ddpdoctor.

Every job runs in its own session and is killed, with all its descendants, whatever the test's
outcome (a hung job would otherwise outlive the test run).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpdoctor.live.attach import pyspy
from ddpdoctor.live.procs import all_procs, find_ranks
from ddpdoctor.supervisor.statuses import read_statuses
from tests.conftest import JOBS, REPO, job_env, torchrun

pytestmark = pytest.mark.e2e
FAULTY = JOBS / "faulty_train.py"
STEADY = JOBS / "steady_train.py"
READY_S = 120  # torchrun start-up on a loaded 2-core machine


class Job:
    """A job in the background; ``output`` grows as it prints (read by a thread, never blocking)."""

    def __init__(self, command: list[str], cwd: Path, **env: str) -> None:
        self.proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=job_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self.output = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output += line

    def printed(self, text: str) -> bool:
        return text in self.output


@contextlib.contextmanager
def background(command: list[str], cwd: Path, **env: str) -> Iterator[Job]:
    job = Job(command, cwd, **env)
    try:
        yield job
    finally:
        kill_tree(job.pid)
        with contextlib.suppress(Exception):
            job.proc.wait(timeout=30)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, every process below it and their process groups (ddpdoctor run starts
    the job in a group of its own)."""
    procs = all_procs()
    below, todo = [pid], [pid]
    while todo:  # torchrun puts each worker in a session of its own: follow parents, not groups
        parent = todo.pop()
        children = [p.pid for p in procs.values() if p.ppid == parent]
        below += children
        todo += children
    groups = set()
    for p in below:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(p))
    for g in groups:
        if g != os.getpgrp():
            with contextlib.suppress(OSError):
                os.killpg(g, signal.SIGKILL)
    for p in below:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def ddpdoctor(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpdoctor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=job_env(),
    )


def wait_for(predicate, what: str, timeout: float = READY_S, every: float = 0.5):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def rank_pids(launcher: int) -> dict[int, int]:
    try:
        _, ranks = find_ranks(launcher)
    except LookupError:
        return {}
    return {r.rank: r.pid for r in ranks}


def in_function(pid: int, name: str) -> bool:
    dump = pyspy(pid)
    return any(name in str(f.get("function")) for t in dump["threads"] for f in t["frames"])


def test_attach_names_the_rank0_evaluation_hang_of_a_plain_torchrun_job(tmp_path: Path) -> None:
    with background(torchrun(2, FAULTY, "--mode", "eval0"), tmp_path) as job:
        pids = wait_for(lambda: len(rank_pids(job.pid)) == 2 and rank_pids(job.pid), "two ranks")
        wait_for(lambda: in_function(pids[0], "_sync_buffers"), "rank 0 in the buffer broadcast")
        out = tmp_path / "attached"
        result = ddpdoctor("attach", str(job.pid), "--watch", "2", "--out", str(out))
        assert result.returncode == 1, result.stdout + result.stderr
        text = result.stdout
        assert f"rank 0 pid {pids[0]}, rank 1 pid {pids[1]}" in text
        assert "STUCK - no rank's stack changed" in text
        assert "rank 0  in DistributedDataParallel.forward -> _sync_buffers (broadcast" in text
        assert "<- evaluate() faulty_train.py:28" in text
        assert "rank 1  in dist.barrier() (collective)  <- main() faulty_train.py:71" in text
        assert "rank 0 runs a DDP forward the others never run at faulty_train.py:28 (evaluate)" in text
        assert "Fix: evaluate model.module on rank 0" in text
        report = json.loads((out / "attach.json").read_text())
        assert report["state"] == "stuck" and report["pattern"] == "rank_only_forward"
        assert report["culprits"] == [0]
        assert report["ranks"]["0"]["user_frame"]["function"] == "evaluate"
        assert report["ranks"]["1"]["user_frame"]["line"] == 71
        assert "c10d::" in (out / "hang-1" / "stack-rank1.txt").read_text(), "native frames of the wait"
        # The run directory reads like one written under `ddpdoctor run`.
        diag = ddpdoctor("diagnose", "--json", str(out))
        assert diag.returncode == 1, diag.stderr
        [hang] = [f for f in json.loads(diag.stdout)["findings"] if f["kind"] == "hang"]
        assert hang["ranks"] == [0] and hang["details"]["pattern"] == "rank_only_forward"
        assert ddpdoctor("report", str(out)).returncode == 0
        assert job.proc.poll() is None, "attach must not disturb the job"


def test_attach_to_a_healthy_job_reports_progress_twice(tmp_path: Path) -> None:
    with background(torchrun(2, STEADY, "--steps", "100000", "--step-s", "0.005"), tmp_path) as job:
        wait_for(lambda: job.printed("training"), "the first step")
        pids = rank_pids(job.pid)
        for target in (job.pid, pids[1]):  # the launcher, then one rank: the same two ranks
            out = tmp_path / f"attached-{target}"
            result = ddpdoctor("attach", str(target), "--watch", "3", "--json", "--out", str(out))
            assert result.returncode == 0, result.stdout + result.stderr
            report = json.loads(result.stdout)
            assert report["state"] == "progressing" and report["pattern"] is None
            assert sorted(report["ranks"]) == ["0", "1"]
            assert any(r["moved"] for r in report["ranks"].values()), report["ranks"]
            assert not (out / "hang-1").exists()
        assert job.proc.poll() is None, job.output


def test_attach_to_a_job_that_sleeps_between_steps_reports_progress(tmp_path: Path) -> None:
    """100 ms sleeps between tiny steps: nearly every look finds each rank in its sleep, at one
    line, so the stacks hardly change (five of five attaches said "stuck" before 7d0587d). The
    main threads, blocked at the looks, ran between them: the job progresses."""
    with background(torchrun(2, STEADY, "--steps", "100000", "--step-s", "0.1"), tmp_path) as job:
        wait_for(lambda: job.printed("training"), "the first step")
        result = ddpdoctor("attach", str(job.pid), "--watch", "3", "--json", "--out", str(tmp_path / "a"))
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads(result.stdout)
        assert report["state"] == "progressing" and report["pattern"] is None, report
        assert job.proc.poll() is None, job.output


def top_frame(run_dir: Path) -> dict:
    result = ddpdoctor("top", "--once", "--json", str(run_dir), timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_top_once_on_a_live_job_and_on_its_finished_run(tmp_path: Path) -> None:
    run_dir, release = tmp_path / "run", tmp_path / "release"
    steady = torchrun(
        2, STEADY, "--steps", "12", "--step-s", "0.02", "--hold-at", "8", "--release", str(release)
    )
    command = [sys.executable, "-m", "ddpdoctor", "run", "--out", str(run_dir), "--", *steady]
    with background(command, tmp_path) as job:
        wait_for(lambda: job.printed("held"), "the hold at step 8")

        def held() -> dict | None:
            if not run_dir.joinpath("status-rank1.json").exists():
                return None
            frame = top_frame(run_dir)
            steps = [r["steps"] for r in frame["ranks"]]
            return frame if steps == [8, 8] and frame["ranks"][1]["op"] == "barrier" else None

        frame = wait_for(held, "both ranks at 8 steps in top", timeout=60, every=1.0)
        # held: alive, and after 10 step periods (at least 2 s) without a step "stalled"
        assert {r["state"] for r in frame["ranks"]} <= {"running", "stalled"}
        assert all(r["late_ms"] is not None for r in frame["ranks"]), "lateness over the recent steps"
        assert frame["runs"][0]["status"] == "running" and not frame["job"]["finished"]
        text = ddpdoctor("top", "--once", str(run_dir)).stdout
        rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"])]
        assert [(r[0], r[4]) for r in rows] == [("0", "8"), ("1", "8")], text
        assert {r[3] for r in rows} <= {"running", "stalled"}, text
        assert "collective barrier" in text
        release.touch()
        assert job.proc.wait(timeout=120) == 0, job.output
    frame = top_frame(run_dir)
    assert frame["job"]["finished"] and frame["runs"][0]["exit_code"] == 0
    assert [(r["rank"], r["steps"], r["state"]) for r in frame["ranks"]] == [
        (0, 12, "exited"),
        (1, 12, "exited"),
    ]
    text = ddpdoctor("top", "--once", str(run_dir)).stdout
    assert "finished, exit 0" in text and "2/2 ranks, 12 steps" in text


@pytest.mark.parametrize("case", ["weights_loaded_after_wrap", "ckpt_before"])
def test_top_compares_the_ranks_weights_while_the_job_trains(tmp_path: Path, case: str) -> None:
    """The issue's reproduction (rank 0 loads weights after wrapping) and its healthy twin (a
    checkpoint loaded before wrapping), 3 ranks held after their first optimizer step."""
    run_dir, release = tmp_path / "run", tmp_path / "release"
    if case == "ckpt_before":
        job_cmd = torchrun(3, JOBS / "divergence.py", "ckpt_before")
    else:
        job_cmd = torchrun(3, REPO / "tests" / "zoo" / f"{case}.py")
    command = [sys.executable, "-m", "ddpdoctor", "run", "--out", str(run_dir), "--", *job_cmd]
    with background(command, tmp_path, RELEASE_FILE=str(release), CKPT_DIR=str(tmp_path)) as job:

        def checked_step0() -> dict[int, int] | None:
            statuses = read_statuses(run_dir)
            params = {
                r: fp["params"]
                for r, st in statuses.items()
                for fp in st.fingerprints or []
                if (fp["model"], fp["step"], fp["at"]) == (0, 0, "step")
            }
            return params if len(params) == 3 else None

        params = wait_for(checked_step0, "every rank's fingerprint after step 0 in its status", every=1.0)
        frame = top_frame(run_dir)
        assert not frame["job"]["finished"]
        found = [f for f in frame["findings"] if f["kind"] == "weights_diverged"]
        if case == "ckpt_before":  # silent, and not for want of looking: the ranks agree
            assert found == [] and len(set(params.values())) == 1, frame["findings"]
        else:
            [f] = found
            assert f["ranks"] == [0] and f["step"] == 0 and f["groups"] == [[1, 2], [0]]
            assert "rank(s) 0 differ from the other ranks' at step 0" in f["text"]
            assert "`ddpdoctor diagnose` names the parameters and the cause" in f["text"]
            text = ddpdoctor("top", "--once", str(run_dir)).stdout
            assert "weights_diverged [rank 0]" in text, text
        release.touch()
        assert job.proc.wait(timeout=120) == 0, job.output
    # The finished run: the final statuses carry the checks taken at exit.
    found = [f for f in top_frame(run_dir)["findings"] if f["kind"] == "weights_diverged"]
    if case == "ckpt_before":
        assert found == []
    else:
        assert [(f["ranks"], f["at"]) for f in found] == [([0], "exit")]


SPAWNED_EVAL0 = """
import sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

def worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)))
    model(torch.randn(4, 8)).sum().backward()
    if rank == 0:
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, 8))  # a buffer broadcast rank 1 never joins
    dist.barrier()

if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=2)
"""


def test_attach_to_an_mp_spawn_parent(tmp_path: Path, write_script) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = write_script("spawned.py", SPAWNED_EVAL0)
    with background([sys.executable, str(script), str(port)], tmp_path) as job:
        pids = wait_for(lambda: len(rank_pids(job.pid)) == 2 and rank_pids(job.pid), "two spawned ranks")
        wait_for(lambda: in_function(pids[0], "_sync_buffers"), "rank 0 in the buffer broadcast")
        result = ddpdoctor("attach", str(job.pid), "--watch", "1", "--out", str(tmp_path / "a"))
        assert result.returncode == 1, result.stdout + result.stderr
        assert "(ranked in mp.spawn's start order)" in result.stdout
        assert "rank 0 runs a DDP forward the others never run at spawned.py:13 (worker)" in result.stdout
        assert "rank 1  in dist.barrier() (collective)  <- worker() spawned.py:14" in result.stdout


def test_attach_without_ptrace_rights_says_what_is_missing(tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root to run attach as another user (setpriv)")
    with background(torchrun(2, STEADY, "--steps", "100000", "--step-s", "0.05"), tmp_path) as job:
        wait_for(lambda: job.printed("training"), "the first step")
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        result = subprocess.run(
            [
                *nobody,
                sys.executable,
                "-m",
                "ddpdoctor",
                "attach",
                str(job.pid),
                "--out",
                str(tmp_path / "a"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=job_env(),
            cwd="/",
        )
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.strip().splitlines() == [
            "ddpdoctor: cannot read the job's processes: the job runs as uid 0 and you are uid 65534 "
            "without CAP_SYS_PTRACE: run it with sudo (sudo -E env PATH=$PATH ddpdoctor attach ...), "
            "or give py-spy CAP_SYS_PTRACE"
        ]
