"""`top` and `attach` pieces on synthetic inputs: status files, /proc tables, stacks, GPU tails."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ddpdoctor.live import top as live_top
from ddpdoctor.live.attach import phase_of
from ddpdoctor.live.gpu import GpuTail
from ddpdoctor.live.procs import CAP_SYS_PTRACE, Proc, find_ranks, ptrace_problem
from ddpdoctor.probes.recent import RecentFingerprints, RecentSteps, combine
from ddpdoctor.trace import schema

MS = 1_000_000  # ns


def test_recent_steps_rate_last_bucket_wait_and_last_collective() -> None:
    recent = RecentSteps(keep=4)
    for step in range(6):
        t = step * 100 * MS  # 10 steps/s
        recent.forward((schema.FORWARD, t, t + 10 * MS, step, 1, 1, 0))
        recent.forward((schema.FORWARD, t + 50 * MS, t + 51 * MS, step, 0, 0, 0))  # eval: not a step
        # Bucket 1 is ready last: its wait (7 ms + step) decides, not bucket 0's longer one.
        recent.allreduce((schema.ALLREDUCE, t + 20 * MS, t + 40 * MS, step, 0, 1024, 2 * step))
        recent.allreduce((schema.ALLREDUCE, t + 30 * MS, t + (37 + step) * MS, step, 1, 1024, 2 * step + 1))
    recent.collective((schema.COLLECTIVE, 0, 590 * MS, 5, "barrier", 0, "WORLD", 2, 12, 0))
    status = recent.status(now_ns=600 * MS)
    assert status["steps_per_s"] == 10.0
    # Step 5's buckets may not all be reduced yet: only completed steps, the last 4 kept.
    assert status["sync_wait_us"] == [[s, (7 + s) * 1000] for s in (1, 2, 3, 4)]
    assert status["last_collective"] == {"op": "barrier", "seq": 12, "ago_s": 0.01}
    recent.finish()
    assert recent.status()["sync_wait_us"][-1] == [5, 12000]


def test_fingerprint_records_become_two_numbers_per_check_in_the_status() -> None:
    recent = RecentFingerprints(keep=2)
    names = {"names": ["w", "b", "bn.running_mean"], "n_params": 2}
    recent.fingerprint(
        (schema.FINGERPRINT, 0, 0, -1, {"model": 0, "at": "init", "values": [1, 2, 3], **names})
    )
    recent.fingerprint((schema.FINGERPRINT, 0, 0, 0, {"model": 0, "at": "step", "values": [1, 5, 3]}))
    recent.fingerprint(
        (schema.FINGERPRINT, 0, 0, 0, {"model": -1, "at": "step", "values": [9], "n_params": 1})
    )
    # A parameter DDP never registered is left out: its divergence is gradients_not_synced.
    recent.fingerprint(
        (schema.FINGERPRINT, 0, 0, 63, {"model": 0, "at": "step", "values": [1, 7, 4], "unsynced": [1]})
    )
    assert recent.status()["fingerprints"] == [
        {
            "model": 0,
            "step": 0,
            "at": "step",
            "params": combine([1, 5]),
            "buffers": combine([3]),
            "seq": None,
        },
        {"model": 0, "step": 63, "at": "step", "params": combine([1]), "buffers": combine([4]), "seq": None},
    ]
    assert len({combine([1, 5]), combine([5, 1]), combine([1, 5, 0]), combine([1, 4])}) == 4
    assert 0 <= combine([2**53 - 1] * 1000) < 2**53


def _status(rank: int, step: int, waits: list[float], **extra: object) -> dict:
    now = time.time()
    return {
        "schema": "ddpdoctor.status/1",
        "rank": rank,
        "world_size": 4,
        "pid": 0,
        "host": "elsewhere",
        "heartbeat_wall": now,
        "progress_wall": now,
        "step": step,
        "events": 100,
        "phase": None,
        "max_step_s": 0.1,
        "steps_per_s": 10.0,
        "sync_wait_us": [[s, w] for s, w in enumerate(waits)],
        **extra,
    }


def _write(run_dir: Path, statuses: list[dict]) -> None:
    run_dir.mkdir(exist_ok=True)
    for st in statuses:
        (run_dir / f"status-rank{st['rank']}.json").write_text(json.dumps(st))


def test_top_names_the_rank_that_arrives_last_at_the_gradient_sync(tmp_path: Path) -> None:
    # Rank 2 gets its last bucket ready 20 ms after the others on every step: the others wait
    # 20 ms longer in the all-reduce.
    waits = {r: [25_000.0 + (r % 2) * 500] * 10 for r in range(4)}
    waits[2] = [5_000.0] * 10
    _write(tmp_path, [_status(r, 9, waits[r]) for r in range(4)])
    frame = live_top.Top([tmp_path]).snapshot()
    late = {row["rank"]: row["late_ms"] for row in frame["ranks"]}
    assert late == {0: 0.5, 1: 0.0, 2: 20.5, 3: 0.0}
    [straggler] = [f for f in frame["findings"] if f["kind"] == "straggler"]
    assert straggler["ranks"] == [2] and "100% of the last 10 steps" in straggler["text"]
    assert frame["job"]["slowest_rank"] == 2 and frame["job"]["steps_min"] == 10
    assert "late/step" in live_top.render(frame)


def test_top_sees_no_straggler_when_the_latest_rank_changes(tmp_path: Path) -> None:
    waits = {r: [25_000.0 - 3_000 * ((s + r) % 4) for s in range(10)] for r in range(4)}
    _write(tmp_path, [_status(r, 9, waits[r]) for r in range(4)])
    frame = live_top.Top([tmp_path]).snapshot()
    assert not [f for f in frame["findings"] if f["kind"] == "straggler"]


def test_top_judges_a_hang_by_the_watchers_own_rule(tmp_path: Path) -> None:
    now = time.time()
    sync = {"name": "sync_buffers", "op": "broadcast", "seq": 40, "since_s": 45.0}
    barrier = {"name": "collective", "op": "barrier", "seq": 40, "since_s": 45.0}
    statuses = [_status(0, 5, [], phase=sync, progress_wall=now - 45)]
    statuses += [_status(r, 5, [], phase=barrier, progress_wall=now - 45) for r in (1, 2, 3)]
    _write(tmp_path, statuses)
    frame = live_top.Top([tmp_path]).snapshot(now)
    [hang] = [f for f in frame["findings"] if f["kind"] == "hang"]
    assert hang["pattern"] == "rank_only_forward" and hang["ranks"] == [0]
    assert hang["text"].startswith("proven: ranks disagree on the op of collective #40")
    assert frame["job"]["since_progress_s"] == 45.0
    # The same job 20 s earlier: the statuses prove it already, as the watcher's proof.judge says.
    _write(
        tmp_path,
        [{**s, "progress_wall": now - 25, "phase": {**s["phase"], "since_s": 25.0}} for s in statuses],
    )
    [hang] = [f for f in live_top.Top([tmp_path]).snapshot(now)["findings"] if f["kind"] == "hang"]
    assert hang["pattern"] == "rank_only_forward"
    # One consistent barrier for 25 s: nothing on record says why, so only the threshold decides.
    waiting = {**barrier, "since_s": 25.0}
    _write(tmp_path, [{**s, "phase": waiting, "progress_wall": now - 25} for s in statuses])
    assert not [f for f in live_top.Top([tmp_path]).snapshot(now)["findings"] if f["kind"] == "hang"]


def test_top_on_several_run_dirs_and_a_finished_one(tmp_path: Path) -> None:
    a, b = tmp_path / "node0", tmp_path / "node1"
    _write(a, [_status(r, 99, [], exited=True) for r in (0, 1)])
    _write(b, [_status(r, 99, [], exited=True) for r in (2, 3)])
    for d in (a, b):
        (d / "run.json").write_text(json.dumps({"status": "finished", "exit_code": 0, "ended_ns": 1}))
    frame = live_top.Top([a, b]).snapshot()
    assert [(r["rank"], r["steps"], r["state"]) for r in frame["ranks"]] == [
        (r, 100, "exited") for r in range(4)
    ]
    assert frame["job"]["finished"] and not [f for f in frame["findings"] if f["kind"] == "hang"]
    assert "4/4 ranks, 100 steps" in live_top.render(frame)
    for d in (a, b):  # instrumented without `ddpdoctor run`: no run.json, the ranks' exits tell
        (d / "run.json").unlink()
    assert live_top.Top([a, b]).snapshot()["job"]["finished"]
    _write(b, [_status(3, 99, [], exited=False)])
    assert not live_top.Top([a, b]).snapshot()["job"]["finished"]


def test_gpu_tail_reads_only_new_lines_and_keeps_the_process_map(tmp_path: Path) -> None:
    path = tmp_path / "gpu-node7.jsonl"
    lines = [
        ["header", {"schema": schema.GPU_SCHEMA}],
        ["gpu_procs", 0, 0, -1, {"gpu": 1, "procs": [[4242, 1024]]}],
        ["gpu", 0, 0, -1, {"gpu": 1, "util": 40}],
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    tail = GpuTail(path)
    tail.poll()
    assert tail.host == "node7" and tail.util == {1: 40.0} and tail.pid_gpu == {4242: 1}
    with open(path, "a") as fh:
        fh.write(json.dumps(["gpu", 1, 0, -1, {"gpu": 1, "util": 90}]) + "\n" + '["gpu", 2, 0, -1, {"gp')
    tail.poll()
    assert tail.util == {1: 90.0} and tail.pid_gpu == {4242: 1}, "a half-written line waits"


def _frames(*calls: tuple[str, str]) -> list[dict]:
    """Frames innermost first from (file, function) pairs given outermost first."""
    return [{"file": f, "line": 1, "function": fn} for f, fn in reversed(calls)]


SITE = "/venv/lib/python3.11/site-packages/torch/"


def test_phase_from_the_stack() -> None:
    user = ("/home/me/train.py", "main")
    ddp = SITE + "nn/parallel/distributed.py"
    broadcast = _frames(
        user,
        ("/home/me/train.py", "evaluate"),
        (ddp, "DistributedDataParallel.forward"),
        (ddp, "DistributedDataParallel._pre_forward"),
        (ddp, "DistributedDataParallel._sync_buffers"),
        (ddp, "DistributedDataParallel._distributed_broadcast_coalesced"),
    )
    assert phase_of(broadcast) == {"name": "sync_buffers", "op": "broadcast"}
    constructing = _frames(
        user,
        (ddp, "DistributedDataParallel.__init__"),
        (SITE + "distributed/utils.py", "_verify_param_shape_across_processes"),
    )
    assert phase_of(constructing) == {"name": "ddp_init", "op": "init"}
    c10d = SITE + "distributed/distributed_c10d.py"
    gather = _frames(
        user,
        (SITE + "distributed/c10d_logger.py", "wrapper"),
        (c10d, "all_gather_object"),
        (c10d, "all_gather"),
    )
    assert phase_of(gather) == {"name": "collective", "op": "all_gather_object"}
    backward = _frames(
        user, (SITE + "_tensor.py", "Tensor.backward"), (SITE + "autograd/__init__.py", "backward")
    )
    assert phase_of(backward) == {"name": "backward", "op": "allreduce"}
    assert phase_of(_frames(user, (c10d, "get_rank"))) is None
    assert phase_of(_frames(user, ("/home/me/train.py", "spin"))) is None


def _procs(*rows: tuple[int, int, dict, list[str]]) -> dict[int, Proc]:
    return {pid: Proc(pid, ppid, 1000, cmd, env) for pid, ppid, env, cmd in rows}


def test_find_ranks_of_torchrun_from_the_launcher_or_any_rank_without_loader_workers() -> None:
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    procs = _procs(
        (100, 1, {}, ["torchrun"]),
        (101, 100, {**env, "RANK": "1", "LOCAL_RANK": "1"}, ["python", "train.py"]),
        (102, 100, {**env, "RANK": "0", "LOCAL_RANK": "0"}, ["python", "train.py"]),
        (103, 102, {**env, "RANK": "0", "LOCAL_RANK": "0"}, ["python", "train.py"]),  # a loader worker
        (104, 1, {**env, "RANK": "0"}, ["python", "other_job.py"]),
    )
    for pid in (100, 101, 103):
        launcher, ranks = find_ranks(pid, procs)
        assert launcher == 100
        assert [(r.rank, r.pid, r.local_rank, r.world_size) for r in ranks] == [
            (0, 102, 0, 2),
            (1, 101, 1, 2),
        ]


def test_a_rank_blocked_at_every_look_that_ran_between_them_moved() -> None:
    """A job of 5 ms sleeps between short steps (CI, 2026-12-06): all seven looks of each rank
    found it in its sleep, so the stacks never changed and attach called a healthy job stuck.
    Its main thread was blocked at every look and had used 27 % of a core meanwhile: it left the
    sleep and came back. A thread blocked in one wait all along uses none; one spinning at one
    line is active at the looks, and stays stuck (busy)."""
    from ddpdoctor.live.attach import RankLooks
    from ddpdoctor.live.procs import RankProc

    def looks(active: bool, main_cpu: float) -> RankLooks:
        frames = [{"file": "/job/train.py", "line": 41, "function": "main"}]
        dump = {"method": "py-spy", "threads": [{"name": "MainThread", "active": active, "frames": frames}]}
        proc = RankProc(0, 10, 0, 2, 2, ["python", "train.py"], "environment")
        return RankLooks(proc, dumps=[dump] * 7, main_cpu=[(0.0, 1.0), (3.0, 1.0 + 3 * main_cpu)])

    assert looks(active=False, main_cpu=0.27).moved, "slept at each look, ran between"
    assert not looks(active=False, main_cpu=0.0).moved, "blocked in one wait all along"
    assert not looks(active=True, main_cpu=1.0).moved, "spinning at one line: stuck, busy"
    assert looks(active=False, main_cpu=0.03).moved, "100 ms sleeps a step: still steps"
    assert not looks(active=False, main_cpu=0.001).moved, "a wait's own stirring is not a step"


def test_find_ranks_of_mp_spawn_in_start_order() -> None:
    spawn = [
        "python",
        "-c",
        "from multiprocessing.spawn import spawn_main; spawn_main()",
        "--multiprocessing-fork",
    ]
    procs = _procs(
        (200, 1, {}, ["python", "train.py"]),
        (201, 200, {}, ["python", "-c", "from multiprocessing.resource_tracker import main;main(5)"]),
        (202, 200, {}, spawn),
        (203, 200, {}, spawn),
        (204, 203, {}, spawn),  # rank 1's own worker
    )
    for pid in (200, 203):
        launcher, ranks = find_ranks(pid, procs)
        assert launcher == 200
        assert [(r.rank, r.pid, r.ranked_by) for r in ranks] == [
            (0, 202, "spawn order"),
            (1, 203, "spawn order"),
        ]


def test_what_is_missing_to_ptrace_in_one_line() -> None:
    cap = 1 << CAP_SYS_PTRACE
    assert ptrace_problem(1000, scope=None, caps=0, uid=1000) == ""
    assert ptrace_problem(1000, scope=1, caps=cap, uid=1000) == ""
    assert "ptrace_scope is 1" in ptrace_problem(1000, scope=1, caps=0, uid=1000)
    assert "sudo" in ptrace_problem(1000, scope=1, caps=0, uid=1000)
    assert "ptrace_scope is 2: only CAP_SYS_PTRACE" in ptrace_problem(1000, scope=2, caps=0, uid=1000)
    assert "uid 0 and you are uid 1000 without CAP_SYS_PTRACE" in ptrace_problem(
        0, scope=None, caps=0, uid=1000
    )
    assert "until reboot" in ptrace_problem(1000, scope=3, caps=cap, uid=0)


def test_a_failing_status_tap_logs_once_and_switches_every_tap_off() -> None:
    from types import SimpleNamespace

    from ddpdoctor.probes.liveness import guarded_taps

    failures: list[str] = []
    c = SimpleNamespace(writer=SimpleNamespace(taps={}), fail=lambda probe, exc: failures.append(probe))
    recent = RecentSteps()
    c.writer.taps.update(guarded_taps(c, recent.taps()))
    c.writer.taps[schema.FORWARD]((schema.FORWARD, 0, 1, 0, 1, 1, 0))
    assert len(recent.starts) == 1 and not failures
    c.writer.taps[schema.ALLREDUCE]((schema.ALLREDUCE, 0, 1))  # too short: the tap raises
    assert failures == ["recent"] and c.writer.taps == {}


def test_writer_taps_see_each_event_of_their_kind_and_the_trace_is_unchanged(tmp_path: Path) -> None:
    from ddpdoctor.trace import binfmt
    from ddpdoctor.trace.writer import TraceWriter

    def write(path: Path, tapped: list | None) -> str:
        writer = TraceWriter(str(path), {"mono_ns": 0, "rank": 0}, flush_interval=60)
        if tapped is not None:
            writer.taps[schema.COLLECTIVE] = tapped.append
            writer.taps[schema.FORWARD] = lambda event: 1 / 0  # a broken tap costs nothing else
        for i in range(5):
            writer.put((schema.FORWARD, i * 1000, i * 1000 + 500, i, 1, 1, 0))
            writer.put((schema.COLLECTIVE, i * 1000, i * 1000 + 9, i, "barrier", 0, "WORLD", 2, i, 0))
        writer.close()
        return str(binfmt.records(binfmt.decode(path.read_bytes()))[:-1])  # less the end (stamped now)

    tapped: list = []
    text = write(tmp_path / "a.bin", tapped)
    assert text == write(tmp_path / "b.bin", None)
    assert text.count("'barrier'") == 5 and text.count("['forward'") == 5
    assert [e[8] for e in tapped] == [0, 1, 2, 3, 4]


def test_top_shows_the_gpu_each_rank_runs_on(tmp_path: Path) -> None:
    lines = [
        ["header", {"schema": schema.GPU_SCHEMA}],
        ["gpu_procs", 0, 0, -1, {"gpu": 1, "procs": [[4242, 1024]]}],
        ["gpu", 0, 0, -1, {"gpu": 0, "util": 15}],
        ["gpu", 0, 0, -1, {"gpu": 1, "util": 93}],
    ]
    (tmp_path / "gpu-node7.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    on_gpu1 = _status(0, 3, [], host="node7", pid=4242, local_rank=0)  # NVML's process list wins
    by_local_rank = _status(1, 3, [], host="node7", pid=4243, local_rank=0)
    elsewhere = _status(2, 3, [], host="node8", pid=4242, local_rank=0)
    _write(tmp_path, [on_gpu1, by_local_rank, elsewhere])
    frame = live_top.Top([tmp_path]).snapshot()
    assert [(r["gpu"] or {}).get("util") for r in frame["ranks"]] == [93.0, 15.0, None]
    assert "g1 93%" in live_top.render(frame)


def test_top_uses_the_runs_hang_timeout_and_defers_to_the_watchers_report(tmp_path: Path) -> None:
    now = time.time()
    barrier = {"name": "collective", "op": "barrier", "seq": 7, "since_s": 12.0}
    _write(tmp_path, [_status(r, 5, [], world_size=2, phase=barrier, progress_wall=now - 12) for r in (0, 1)])
    assert not [f for f in live_top.Top([tmp_path]).snapshot(now)["findings"] if f["kind"] == "hang"]
    (tmp_path / "watch.json").write_text(json.dumps({"hang_timeout": 10}))
    [hang] = [f for f in live_top.Top([tmp_path]).snapshot(now)["findings"] if f["kind"] == "hang"]
    assert hang["pattern"] == "backend_stuck" and "(threshold 10 s)" in hang["text"]
    (tmp_path / "hang-1").mkdir()
    (tmp_path / "hang-1" / "summary.json").write_text(json.dumps({"text": "ddpdoctor: HANG - the watcher's"}))
    kinds = [(f["kind"], f["text"]) for f in live_top.Top([tmp_path]).snapshot(now)["findings"]]
    assert kinds == [("hang_reported", "ddpdoctor: HANG - the watcher's")]


def test_a_check_after_a_step_carries_that_steps_first_gradient_all_reduce() -> None:
    """Under a Join a rank's step count stands still while it shadows the others' all-reduces:
    the sequence number of the all-reduce each step begins with is what the ranks share."""
    steps = RecentSteps(keep=4)
    recent = RecentFingerprints(steps=steps)
    names = {"names": ["w"], "n_params": 1}
    for step, seqs in ((46, (145, 144)), (46, (148,)), (47, (184, 185))):  # buckets finish in any order
        for q in seqs:
            steps.allreduce((schema.ALLREDUCE, 0, 1, step, 0, 64, q))
    recent.fingerprint((schema.FINGERPRINT, 0, 0, 47, {"model": 0, "at": "step", "values": [3], **names}))
    recent.fingerprint((schema.FINGERPRINT, 0, 0, 47, {"model": 0, "at": "exit", "values": [3]}))
    assert [(c["step"], c["at"], c["seq"]) for c in recent.status()["fingerprints"]] == [
        (47, "step", 184),
        (47, "exit", None),
    ]
    assert steps.first_seq(46) == 144 and steps.first_seq(12) is None


def _fp(
    step: int, params: int, buffers: int = 7, at: str = "step", model: int = 0, seq: int | None = None
) -> dict:
    return {"model": model, "step": step, "at": at, "params": params, "buffers": buffers, "seq": seq}


def test_top_lines_the_ranks_checks_up_by_their_steps_first_all_reduce(tmp_path: Path) -> None:
    """Rank 0 ran out of batches under a Join and shadowed 11 of rank 1's steps: its step 47 is
    rank 1's 58 (both began with all-reduce #184). Equal there: quiet; rank 0's step 58 is
    another moment, never compared. Different there: named, with rank 1's count."""
    equal = {0: [_fp(47, 5, seq=184), _fp(58, 9, seq=217)], 1: [_fp(58, 5, seq=184)]}
    assert _diverged(tmp_path, equal) == []
    [f] = _diverged(tmp_path, {0: [_fp(47, 5, seq=184)], 1: [_fp(58, 6, seq=184)]})
    assert f["ranks"] == [0, 1] and f["step"] == 58 and "at step 58, after its optimizer step" in f["text"]
    # a status from before checks carried it: the ranks' own steps, as they were
    assert [g["step"] for g in _diverged(tmp_path, {0: [_fp(58, 5, seq=184)], 1: [_fp(58, 6)]})] == [58]


def _diverged(run_dir: Path, checks: dict[int, list[dict]]) -> list[dict]:
    _write(run_dir, [_status(r, 200, [], fingerprints=fps) for r, fps in checks.items()])
    return [f for f in live_top.Top([run_dir]).snapshot()["findings"] if f["kind"] == "weights_diverged"]


def test_top_compares_the_ranks_parameters_at_the_latest_check_they_all_took(tmp_path: Path) -> None:
    base = [_fp(-1, 10, at="init"), _fp(63, 11), _fp(127, 12)]
    # Rank 2's parameters differ from the majority's at step 127: named, with the step.
    checks = {r: list(base) for r in range(4)}
    checks[2] = [*base[:2], _fp(127, 99)]
    [f] = _diverged(tmp_path, checks)
    assert f["ranks"] == [2] and f["step"] == 127 and f["model"] == 0 and f["groups"] == [[0, 1, 3], [2]]
    assert "rank(s) 2 differ from the other ranks' at step 127, after its optimizer step" in f["text"]
    assert "`ddpdoctor diagnose` names the parameters and the cause" in f["text"]
    # Rank 3 already checked step 191 (a different number: different weights, or not): only the
    # latest check every rank has, step 127, is compared.
    checks[3] = [*base[1:], _fp(191, 55)]
    assert [f["step"] for f in _diverged(tmp_path, checks)] == [127]
    checks[2] = list(base)
    assert _diverged(tmp_path, checks) == []
    # Equal parameters, buffers that differ (BatchNorm statistics): silent.
    assert _diverged(tmp_path, {r: [_fp(63, 11, buffers=r)] for r in range(4)}) == []
    # No step in common, or a rank without a check yet: nothing to compare.
    assert _diverged(tmp_path, {r: [_fp(63 + r, r)] for r in range(4)}) == []
    assert _diverged(tmp_path, {0: [_fp(63, 1)], 1: [_fp(63, 2)], 2: [_fp(63, 1)], 3: []}) == []
    # Two ranks at exit: no majority, both named; another model of the same ranks is its own.
    (tmp_path / "status-rank2.json").unlink(), (tmp_path / "status-rank3.json").unlink()
    two = {0: [_fp(99, 1, at="exit"), _fp(99, 5, model=1)], 1: [_fp(99, 2, at="exit"), _fp(99, 5, model=1)]}
    [f] = _diverged(tmp_path, two)
    assert (
        f["ranks"] == [0, 1]
        and f["model"] == 0
        and "differ across ranks 0-1 (no majority) at exit (step 99)" in f["text"]
    )
    assert "  weights_diverged [" in live_top.render(live_top.Top([tmp_path]).snapshot())


def test_a_rank_error_record_reads_no_source_file() -> None:
    """torchrun stops a dead rank's peers within milliseconds: the survivor's error record must
    not wait for source lines to be read (linecache), or the record of where it was is lost."""
    import linecache

    from ddpdoctor.probes.liveness import _format_error

    def fail() -> None:
        try:
            raise KeyError("root")
        except KeyError as err:
            raise ValueError("bad batch at step 3") from err

    try:
        fail()
    except ValueError as exc:
        linecache.clearcache()
        info = _format_error(ValueError, exc, exc.__traceback__, "MainThread")
        assert not linecache.cache  # nothing was read
    assert info["type"] == "ValueError" and info["message"] == "bad batch at step 3"
    assert [f[2] for f in info["frames"]] == ["test_a_rank_error_record_reads_no_source_file", "fail"]
    assert info["frames"][1][0] == __file__
    assert info["traceback"].startswith("Traceback (most recent call last):\n  File ")
    assert info["traceback"].endswith("ValueError: bad batch at step 3\n")
    # its cause too, first, as Python prints it (the analysis reads the causes' messages)
    cause, _, last = info["traceback"].partition("The above exception was the direct cause")
    assert "KeyError: 'root'" in cause and "in fail\n" in cause and "ValueError" in last
