"""Pure unit tests: hang diagnosis, thresholds, stack parsing, startup lines, rank failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpdoctor.analysis import diagnose
from ddpdoctor.analysis.hung.hang import analyse, main_thread, user_frame
from ddpdoctor.probes.startup import classify
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.supervisor.statuses import adaptive_threshold
from ddpdoctor.supervisor.watch import Watcher
from ddpdoctor.trace.reader import load_run
from ddpdoctor.trace.stacktext import is_user_frame, parse_faulthandler

TORCH = "/usr/lib/python3.11/site-packages/torch/nn/parallel/distributed.py"


def status(rank: int, name: str | None, op: str = "", seq: int = 57, since: float = 31.0, **kw) -> dict:
    phase = {"name": name, "op": op, "seq": seq, "since_s": since} if name else None
    return {"rank": rank, "pid": 1000 + rank, "heartbeat_wall": 100.0, "phase": phase} | kw


def stack(*frames: tuple[str, int, str]) -> dict:
    """A dump of one main thread; frames given innermost first."""
    return {
        "method": "py-spy",
        "threads": [
            {"name": "MainThread", "frames": [{"file": f, "line": n, "function": fn} for f, n, fn in frames]}
        ],
    }


EVAL_STACK = stack(
    (TORCH, 2363, "_sync_buffers"), ("/home/u/train.py", 88, "evaluate"), ("/home/u/train.py", 120, "main")
)
BARRIER_STACK = stack(
    ("/usr/lib/python3.11/site-packages/torch/distributed/c10d.py", 10, "barrier"),
    ("/home/u/train.py", 95, "main"),
)


def test_rank0_evaluation_through_the_wrapper() -> None:
    statuses = {0: status(0, "sync_buffers", "broadcast")} | {
        r: status(r, "collective", "barrier") for r in (1, 2, 3)
    }
    stacks = {0: EVAL_STACK} | {r: BARRIER_STACK for r in (1, 2, 3)}
    diag = analyse(statuses, stacks, threshold_s=30, now=100.0)
    assert diag.pattern == "rank_only_forward" and diag.culprits == [0]
    text = diag.text("RUN/hang-1")
    assert "ddpdoctor: HANG - no progress for 31 s" in text
    assert (
        "rank 0    in DistributedDataParallel.forward -> _sync_buffers (broadcast, collective #57)"
        "  <- evaluate() train.py:88" in text
    )
    assert "rank 1-3  in dist.barrier() (collective #57)  <- main() train.py:95" in text
    assert (
        "Ranks disagree on collective #57 (broadcast vs barrier): "
        "rank 0 runs a DDP forward the others never run" in text
    )
    assert "Fix: evaluate model.module on rank 0 (no collectives), or evaluate on every rank." in text
    finding = diag.finding("RUN/hang-1").to_json()
    assert finding["kind"] == "hang" and finding["details"]["ranks"]["0"]["user_frame"]["line"] == 88


def test_a_barrier_against_another_collective_claims_no_skip_in_one_look() -> None:
    # A rank that skipped the barrier and a rank that logs alone look the same here: the
    # ledger, which knows the lines each rank executed, decides after the run.
    statuses = {0: status(0, "collective", "barrier"), 1: status(1, "collective", "all_reduce")}
    diag = analyse(statuses, {}, threshold_s=3)
    assert diag.pattern == "collective_order" and diag.culprits == [0, 1]
    assert "skipped" not in diag.explanation and "dist.barrier() on every rank" not in diag.fix


def test_same_op_with_another_root_is_a_mismatch_not_a_stuck_backend() -> None:
    statuses = {r: status(r, "collective", "broadcast") for r in (0, 1)}
    for r in (0, 1):
        statuses[r]["phase"].update(dtype="int64", numel=1, root=r, ranks="")
    diag = analyse(statuses, {}, threshold_s=3)
    assert diag.pattern == "collective_mismatch" and "rank 0 src=0, rank 1 src=1" in diag.explanation
    assert "src" in diag.fix and "NCCL" not in diag.fix


def test_different_order_of_collectives() -> None:
    statuses = {0: status(0, "collective", "all_reduce"), 1: status(1, "collective", "broadcast")}
    assert analyse(statuses, {}, threshold_s=3).pattern == "collective_order"


def test_rank_stuck_in_user_code() -> None:
    statuses = {0: status(0, "backward", "allreduce"), 1: status(1, None)}
    stacks = {1: stack(("/home/u/data.py", 12, "load"), ("/home/u/train.py", 40, "main"))}
    diag = analyse(statuses, stacks, threshold_s=3)
    assert diag.pattern == "user_code" and diag.culprits == [1]
    assert "rank 1 is stuck in user code at data.py:12 (load)" in diag.explanation


def test_rank_waiting_for_its_data_loader() -> None:
    statuses = {0: status(0, "collective", "all_reduce"), 1: status(1, "data", "next", seq=-1)}
    assert analyse(statuses, {}, threshold_s=3).pattern == "data_loader"


def test_ranks_at_different_sequence_numbers() -> None:
    statuses = {0: status(0, "collective", "barrier", seq=10), 1: status(1, "collective", "barrier", seq=11)}
    diag = analyse(statuses, {}, threshold_s=3)
    assert diag.pattern == "seq_mismatch" and diag.culprits == [0]


def test_all_in_the_same_collective_blames_the_backend_and_missing_ranks_are_named() -> None:
    same = {r: status(r, "collective", "all_reduce") for r in (0, 1)}
    assert analyse(same, {}, threshold_s=3).pattern == "backend_stuck"
    diag = analyse(same, {}, threshold_s=3, world_size=3)
    assert diag.pattern == "rank_missing" and diag.culprits == [2]


def test_user_frames_skip_libraries_and_ddpdoctor() -> None:
    import ddpdoctor.probes.ddp as probe

    assert not is_user_frame(TORCH) and not is_user_frame(probe.__file__) and not is_user_frame("<frozen x>")
    assert is_user_frame("/home/u/train.py") and is_user_frame("train.py")
    assert not is_user_frame("numpy/random/_bounded_integers.pyx")  # a compiled extension's
    assert user_frame(main_thread(EVAL_STACK["threads"]))["function"] == "evaluate"
    # A run recorded by another checkout of ddpdoctor (a cluster's, read on a laptop)
    assert not is_user_frame("/opt/src/ddpdoctor/ddpdoctor/probes/ddp.py")


def test_adaptive_threshold_and_sync_wait() -> None:
    assert adaptive_threshold({}, 30, 5) == 30
    assert (
        adaptive_threshold({0: RankStatus(0, max_step_s=2.0), 1: RankStatus(1, max_step_s=9.0)}, 30, 5) == 45
    )
    barrier = RankStatus.of(status(0, "collective", "barrier", since=4.0))
    assert barrier.sync_wait_s(now=101.5) == pytest.approx(5.5) and barrier.waits_now(101.5, 5.0)
    assert barrier.in_phase_s(None) == 4.0, "without a now, the time the status says"
    data = RankStatus.of(status(0, "data", "next", since=40.0))
    assert data.sync_wait_s(now=100) == 0.0 and data.in_phase_s(100) == 40.0 and not data.waits_now(100)
    assert RankStatus.of(status(0, None)).sync_wait_s(now=100) == 0.0


def _write_status(run_dir: Path, rank: int, **kw) -> None:
    kw.setdefault("pid", os.getpid())  # alive: a dead pid would count as a rank exit
    (run_dir / f"status-rank{rank}.json").write_text(json.dumps(status(rank, **kw)))


def test_watcher_fires_once_per_hang_and_rearms_on_progress(tmp_path: Path) -> None:
    reports: list[str] = []
    w = Watcher(tmp_path, hang_timeout=3, report=reports.append, use_pyspy=False, since_wall=0)
    for r in (0, 1):
        _write_status(tmp_path, r, name="collective", op="barrier", since=1.0, events=5, step=2)
    assert w.poll_once(now=100.0) is None  # 1 s in a barrier: fine
    for r in (0, 1):
        _write_status(tmp_path, r, name="collective", op="barrier", since=4.0, events=5, step=2)
    summary = w.poll_once(now=100.0)
    assert summary is not None and summary["n"] == 1 and "HANG" in reports[0]
    assert (tmp_path / "hang-1" / "summary.json").exists()
    assert w.poll_once(now=100.0) is None  # the same hang is not reported twice
    _write_status(tmp_path, 0, name=None, events=9, step=3)
    assert w.poll_once(now=101.0) is None, "rank 1 still waits: the same hang, not a new one"
    assert w.hangs[0]["recovered"] is False
    _write_status(tmp_path, 1, name=None, events=9, step=3)
    assert w.poll_once(now=101.5) is None and w.hangs[0]["recovered"] is True
    assert len(w.hangs) == 1


def test_watcher_ignores_a_healthy_slow_job_and_dead_pids_are_exits(tmp_path: Path) -> None:
    w = Watcher(tmp_path, floor_s=2, report=lambda t: None, use_pyspy=False, since_wall=0)
    for r in (0, 1):
        _write_status(
            tmp_path, r, name="backward", op="allreduce", since=2.5, events=5, step=4, max_step_s=1.0
        )
    assert w.poll_once(now=100.0) is None  # 2.5 s > floor, but < 5 x 1 s
    (tmp_path / "status-rank1.json").write_text(json.dumps(status(1, None) | {"pid": 2**22 + 7}))
    w.poll_once(now=100.0)
    assert 1 not in w.exits, "a heartbeat written this second is proof of life: no syscall spent"
    w.poll_once(now=101.5)
    assert 1 in w.exits


def test_parse_faulthandler() -> None:
    text = (
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n\n'
        "Current thread 0x00007f02 (most recent call first):\n"
        '  File "/home/u/train.py", line 34 in spin\n'
        '  File "/home/u/train.py", line 60 in main\n'
        '  File "/home/u/train.py", line 74 in <module>\n'
    )
    threads = parse_faulthandler(text)
    assert len(threads) == 2 and threads[1]["name"] == "MainThread"
    assert main_thread(threads)[0] == {"file": "/home/u/train.py", "line": 34, "function": "spin"}


@pytest.mark.parametrize(
    ("exc", "message", "kind"),
    [
        ("DistNetworkError", "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE", "port_in_use"),
        (
            "DistStoreError",
            "Timed out after 301 seconds waiting for clients. 1/2 clients joined.",
            "world_size_mismatch",
        ),
        ("RendezvousTimeoutError", "", "rendezvous_timeout"),
        ("RuntimeError", "Distributed package doesn't have NCCL built in", "backend_unavailable"),
        ("ValueError", "Invalid backend: 'foo'", "backend_unavailable"),
    ],
)
def test_startup_failures_are_classified(exc: str, message: str, kind: str) -> None:
    found = classify(exc, message)
    assert found is not None and found[0] == kind and "\n" not in found[1]


def test_unrelated_errors_are_not_startup_failures() -> None:
    assert classify("ValueError", "bad batch at step 3") is None


def _trace(run_dir: Path, rank: int, *records: list) -> None:
    header = [
        "header",
        {"schema": "ddpdoctor.trace/1", "rank": rank, "world_size": 2, "wall_ns": 0, "mono_ns": 0},
    ]
    lines = [header, ["forward", 10, 5, 3, 1, 1, 20], *records]
    (run_dir / f"trace-rank{rank}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_rank_failure_prefers_the_rank_whose_own_code_raised(tmp_path: Path) -> None:
    own = {
        "type": "ValueError",
        "message": "bad",
        "traceback": "tb",
        "frames": [["t.py", 5, "main"]],
        "thread": "MainThread",
        "wall_ns": 2_000_000_000,
    }
    peer = {
        "type": "RuntimeError",
        "message": "Connection reset by peer",
        "traceback": "",
        "frames": [],
        "thread": "MainThread",
        "wall_ns": 1_000_000_000,
    }  # earlier, but only a consequence
    _trace(tmp_path, 0, ["rank_error", 20, 0, 3, peer])
    _trace(tmp_path, 1, ["rank_error", 20, 0, 3, own])
    (tmp_path / "run.json").write_text(json.dumps({"exit_code": 1}))
    [f] = [f for f in diagnose(load_run([tmp_path])).findings if f.kind == "rank_failure"]
    assert f.ranks == [1] and f.details["exception"]["type"] == "ValueError"


def test_a_vanished_rank_without_exception_is_killed_by_a_signal(tmp_path: Path) -> None:
    _trace(tmp_path, 0, ["end", 30, 0, 3, {"reason": "signal 15"}])
    _trace(tmp_path, 1)
    (tmp_path / "run.json").write_text(json.dumps({"exit_code": 1}))
    exits = {
        "1": {
            "pid": 5,
            "seen_wall": 3.0,
            "last_heartbeat_wall": 2.5,
            "signal": 9,
            "step": 3,
            "others": {"0": {"phase": "collective", "op": "barrier", "seq": 7, "step": 3}},
        }
    }
    (tmp_path / "watch.json").write_text(json.dumps({"rank_exits": exits, "rank_errors": {}}))
    [f] = [f for f in diagnose(load_run([tmp_path])).findings if f.kind == "rank_failure"]
    assert f.ranks == [1] and f.details["killed_by_signal"] and "SIGKILL" in f.summary
    assert "rank 0: in dist.barrier() (collective #7)" in f.summary


def test_the_rank_that_died_first_is_the_root_whatever_its_last_heartbeat(tmp_path: Path) -> None:
    """CI: rank 1 sent itself SIGTERM at .805 s, torchrun then stopped rank 0 (SIGTERM at .877 s),
    and rank 0's last heartbeat (.681) was older than rank 1's (.750): heartbeats come 4 a
    second, the deaths 72 ms apart. Each rank's own last words say when, and whether the
    launcher's SIGTERM was a consequence."""
    _trace(tmp_path, 0)
    _trace(tmp_path, 1)
    (tmp_path / "run.json").write_text(json.dumps({"exit_code": 1}))
    exits = {
        str(r): {"pid": 5 + r, "seen_wall": 66.9, "last_heartbeat_wall": beat, "signal": None, "step": 9}
        for r, beat in ((0, 65.681), (1, 65.750))
    }
    (tmp_path / "watch.json").write_text(json.dumps({"rank_exits": exits, "rank_errors": {}}))
    ends = {
        "0": {"how": "signal", "signal": "SIGTERM", "at_wall": 65.877, "consequence": True},
        "1": {"how": "signal", "signal": "SIGTERM", "at_wall": 65.805, "consequence": False},
    }
    (tmp_path / "ends.json").write_text(json.dumps({"ranks": ends, "first": 1}))
    [f] = [f for f in diagnose(load_run([tmp_path])).findings if f.kind == "rank_failure"]
    assert f.ranks == [1] and "rank 1 was killed by SIGTERM" in f.summary, f.summary


def test_a_clean_run_has_no_rank_failure(tmp_path: Path) -> None:
    _trace(tmp_path, 0, ["end", 30, 0, 3, {"reason": "exit"}])
    (tmp_path / "run.json").write_text(json.dumps({"exit_code": 0}))
    assert not [f for f in diagnose(load_run([tmp_path])).findings if f.kind == "rank_failure"]


def test_statuses_left_by_an_earlier_run_in_the_same_dir_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "status-rank0.json").write_text(json.dumps(status(0, "collective", "barrier", since=99.0)))
    w = Watcher(tmp_path, hang_timeout=3, report=lambda t: None, use_pyspy=False)  # heartbeat 100.0: old
    assert w.poll_once(now=200.0) is None and not w.exits and not w.hangs


def test_watcher_declares_a_proven_hang_on_its_first_look_whatever_the_threshold(tmp_path: Path) -> None:
    reports: list[str] = []
    w = Watcher(tmp_path, report=reports.append, use_pyspy=False, since_wall=0)  # auto: 30 s floor
    _write_status(tmp_path, 0, name="sync_buffers", op="broadcast", since=1.6, events=5, step=2)
    _write_status(tmp_path, 1, name="collective", op="barrier", since=1.6, events=5, step=2)
    summary = w.poll_once(now=100.0)
    assert summary is not None and summary["verdict"]["state"] == "proven" and summary["threshold_s"] == 30
    assert reports[0].startswith("ddpdoctor: HANG - proven after 1.6 s: ranks disagree on the op")


def _process(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_watcher_tells_a_busy_rank_from_a_stalled_one(tmp_path: Path) -> None:
    busy, asleep = _process("while True: pass"), _process("import time; time.sleep(60)")
    try:
        for name, pid, expect in (("busy", busy.pid, None), ("stalled", asleep.pid, "stalled")):
            run_dir = tmp_path / name
            run_dir.mkdir()
            w = Watcher(run_dir, floor_s=2, report=lambda t: None, use_pyspy=False, since_wall=0)
            t0 = time.time()
            while time.time() - t0 < 4.5 and not w.hangs:
                now = time.time()
                for r, kw in ((0, {"name": None, "pid": pid}), (1, {"name": "collective", "op": "barrier"})):
                    status = status_at(r, now, since=now - t0 + 1.0, events=5, step=2, **kw)
                    (run_dir / f"status-rank{r}.json").write_text(json.dumps(status))
                w.poll_once(now)
                time.sleep(0.3)
            if expect is None:
                assert not w.hangs, "a rank that burns CPU is busy, not hung"
                assert w._notes.current is not None and (run_dir / "waiting.json").exists()
            else:
                assert w.hangs and w.hangs[0]["verdict"]["state"] == "stalled"
                assert w.hangs[0]["verdict"]["culprits"] == [0]
    finally:
        busy.kill(), asleep.kill()
        busy.wait(), asleep.wait()


def status_at(rank: int, now: float, since: float, **kw) -> dict:
    kw.setdefault("pid", os.getpid())
    name = kw.pop("name")
    op = kw.pop("op", "")
    return status(rank, name, op=op, since=since, **kw) | {"heartbeat_wall": now}


def test_a_new_group_only_some_ranks_create_is_named_with_its_fix() -> None:
    statuses = {0: status(0, "collective", "new_group"), 1: status(1, "collective", "all_reduce")}
    diag = analyse(statuses, {}, threshold_s=3)
    assert diag.culprits == [0] and "create a process group (new_group)" in diag.explanation
    assert "new_group(...) on every rank" in diag.fix


def test_a_new_group_while_the_others_construct_ddp_blames_the_creator() -> None:
    statuses = {0: status(0, "collective", "new_group"), 1: status(1, "ddp_init", "init")}
    diag = analyse(statuses, {}, threshold_s=3)
    assert diag.pattern == "collective_order" and diag.culprits == [0]
    assert "rank 1  in DistributedDataParallel.__init__" in diag.text()
    assert "new_group(...) on every rank" in diag.fix
