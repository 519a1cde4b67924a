"""The fault matrix and multi-node runs: every case ends with a readable run dir and a report,
and leaves the job's own behaviour (results, handlers, exit code) as it would be without us."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import JOBS, diagnose_json, free_port, job_env, read_lines, run_doctor, run_plain, torchrun

from ddpdoctor.trace import binfmt, schema
from ddpdoctor.trace.merge import time_base
from ddpdoctor.trace.reader import load_run

pytestmark = pytest.mark.e2e


def start_doctor(cwd: Path, command: list[str], *options: str, out: str = "run", **env: str):
    """Start `ddpdoctor run` with unbuffered binary pipes: lines read with readline() are never
    lost to a later communicate(), which reads the file descriptors directly."""
    return subprocess.Popen(
        [sys.executable, "-m", "ddpdoctor", "run", "--out", str(cwd / out), *options, "--", *command],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        env=job_env(**env),
    )


def assert_readable_with_report(run_dir: Path, ranks: int) -> dict:
    diag = diagnose_json(run_dir)
    assert diag["run"]["ranks"] == list(range(ranks))
    assert (run_dir / "report.html").stat().st_size > 100_000
    return diag


def test_multinode_on_one_machine_with_a_skewed_node(tmp_path: Path) -> None:
    port = free_port()
    skew_s = 2.0
    procs = []
    for node in (0, 1):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(JOBS / "skewed_clock_train.py"),
        ]
        env = {"TEST_CLOCK_SKEW_S": str(skew_s), "TEST_CLOCK_SKEW_RANKS": "2,3"} if node else {}
        procs.append(start_doctor(tmp_path, command, out=f"node{node}", **env))
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    diag = diagnose_json(*dirs)
    assert diag["run"]["world_size"] == 4 and diag["run"]["ranks"] == [0, 1, 2, 3]
    assert diag["run"]["steps"] == {str(r): 6 for r in range(4)}
    assert not [f for f in diag["findings"] if f["severity"] != "info"]
    # One view, one time base: node 1's wall clocks are 2 s off and its clock probe measures that
    # within its bound, half the best round trip (plus a clock read's slack).
    run = load_run(dirs)
    raw = [run.ranks[r].wall_offset_us() for r in (0, 2)]
    assert abs((raw[1] - raw[0]) / 1e6 - skew_s) < 1.0
    tb = time_base(run)
    for rank in (2, 3):
        bound = (tb.rtt_us[rank] or 0) // 2 + 1_000
        assert abs(tb.clock_offset_us[rank] + skew_s * 1e6) < bound, (tb.clock_offset_us, tb.rtt_us)
    # On the common base each rank's barrier exits sit among the others'. A misaligned rank is
    # off at every step, so its median says so; a single step's spread also holds the host's
    # scheduling (2 cores, 4 ranks): the last barrier releases ranks into their exit work, and
    # a rank, or its gloo thread, that waits on a run queue for it exits tens of ms late.
    ends = []
    for rank in range(4):
        coll = run.ranks[rank].kind(schema.COLLECTIVE)
        keep = np.array([f[0] == "barrier" for f in coll.fields])
        ends.append(tb.rel(rank, coll.end[keep]))
    exits = np.stack(ends)
    per_rank = np.median(exits - np.median(exits, axis=0), axis=1)
    assert np.max(np.abs(per_rank)) < 5_000, per_rank  # µs
    out = tmp_path / "merged.html"
    proc = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "report", *map(str, dirs), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=job_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "rank 3" in out.read_text()


@pytest.mark.parametrize(
    ("target", "sig"),
    [
        ("launcher", signal.SIGINT),
        ("launcher", signal.SIGTERM),
        ("doctor", signal.SIGINT),
        ("doctor", signal.SIGTERM),
    ],
)
def test_signals_reach_the_job_and_everything_is_kept(tmp_path: Path, target: str, sig: int) -> None:
    proc = start_doctor(tmp_path, torchrun(2, JOBS / "signals_train.py"))
    assert proc.stdout is not None
    lines: list[str] = []
    while "ready" not in lines:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        lines.append(line.decode().strip())
    pid = proc.pid
    if target == "launcher":
        pid = json.loads((tmp_path / "run" / "run.json").read_text())["pid"]
    os.kill(pid, sig)
    out, err = (b.decode() for b in proc.communicate(timeout=90))
    lines += out.splitlines()
    # The job's own handlers ran, as they would without ddpdoctor.
    assert {"usr1 handled 0", "usr1 handled 1"} <= set(lines), (lines, err)
    if sig == signal.SIGTERM:
        assert {"term handled 0", "term handled 1"} <= set(lines), err
    diag = assert_readable_with_report(tmp_path / "run", 2)
    assert diag["run"]["exit_code"] == proc.returncode
    assert all(diag["phases"][r]["backward"]["count"] == 5 for r in ("0", "1"))


@pytest.mark.parametrize(
    ("target", "error", "warning"),
    [
        ("/dev/full", "No space left on device", "rank 1 stopped recording"),  # writes fail
        ("/sys/ddpdoctor-cannot-create", "Permission denied", "rank 1 not recorded"),  # read-only, root too
    ],
)
def test_trace_file_full_or_not_writable(tmp_path: Path, target: str, error: str, warning: str) -> None:
    """Rank 1 cannot write its trace: it stops recording, training finishes unchanged."""
    plain = run_plain(tmp_path, torchrun(2, JOBS / "seeded_train.py", "plain.pt"))
    assert plain.returncode == 0, plain.stderr
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "trace-rank1.bin").symlink_to(target)
    job = run_doctor(tmp_path, torchrun(2, JOBS / "seeded_train.py", "doc.pt"))
    assert job.returncode == 0, job.stderr
    assert job.stderr.count(warning) == 1, job.stderr
    assert error in (run_dir / "probe-errors.log").read_text()
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "doc.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    diag = diagnose_json(run_dir)
    assert diag["run"]["ranks"] == [0]
    assert "missing_ranks" in {f["kind"] for f in diag["findings"]}


def test_truncated_and_corrupt_records_are_skipped_and_counted(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, JOBS / "counted_train.py"))
    assert job.returncode == 0, job.stderr
    path = job.run_dir / "trace-rank1.bin"
    data = bytearray(path.read_bytes())
    metas = [start for tag, start, _ in binfmt.blocks(bytes(data)) if tag == binfmt.META]
    data[metas[0]] = ord("#")  # a record that is not JSON
    path.write_bytes(bytes(data[: metas[-1] + 5]))  # the last record cut short

    diag = diagnose_json(job.run_dir)
    assert any("skipped 2 truncated or corrupt" in note for note in diag["run"]["notes"])
    assert diag["run"]["steps"] == {"0": 24, "1": 24}
    proc = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "report", str(job.run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=job_env(),
    )
    assert proc.returncode == 0, proc.stderr


def test_mismatched_collectives_are_diagnosed(tmp_path: Path, write_script) -> None:
    script = write_script(
        "mismatch.py",
        """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(4)
        for _ in range(3):
            dist.all_reduce(t)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=1)
        dist.barrier()
        """,
    )
    job = run_doctor(tmp_path, torchrun(2, script), "--hang-timeout", "3", "--on-hang", "kill")
    assert job.returncode == 124
    assert "Ranks disagree on collective #3 (all_reduce vs broadcast)" in job.stderr
    diag = assert_readable_with_report(job.run_dir, 2)
    (hang,) = [f for f in diag["findings"] if f["kind"] == "hang"]
    assert hang["details"]["pattern"] == "collective_order"


def test_py_spy_refused_falls_back_to_faulthandler(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "py-spy").write_text("#!/bin/sh\necho 'Error: Permission Denied' >&2\nexit 1\n")
    (fake / "py-spy").chmod(0o755)
    job = run_doctor(
        tmp_path,
        torchrun(2, JOBS / "faulty_train.py", "--mode", "eval0"),
        "--hang-timeout",
        "3",
        "--on-hang",
        "kill",
        DDPDOCTOR_PYSPY=str(fake / "py-spy"),
    )
    assert job.returncode == 124, job.stderr
    summary = json.loads((job.run_dir / "hang-1" / "summary.json").read_text())
    methods = {str(r): d.get("method") for r, d in summary["stacks"].items()}
    assert set(methods.values()) == {"faulthandler"}, methods
    assert "evaluate" in job.stderr


def test_a_full_event_buffer_drops_events_not_results(tmp_path: Path) -> None:
    """With a 3-event buffer most events are dropped (and counted); the results are unchanged."""
    plain = run_plain(tmp_path, torchrun(2, JOBS / "seeded_train.py", "plain.pt"))
    job = run_doctor(
        tmp_path, torchrun(2, JOBS / "seeded_train.py", "doc.pt"), DDPDOCTOR_BUFFER_EVENTS="3"
    )  # a tiny buffer: most events are dropped
    assert plain.returncode == job.returncode == 0, job.stderr
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "doc.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    dropped = [r for r in read_lines(job.run_dir / "trace-rank0.jsonl") if r[0] == "dropped"]
    assert dropped and dropped[-1][4]["count"] > 0
