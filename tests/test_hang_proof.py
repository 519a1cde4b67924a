"""Pure unit tests of the hang proof (proven / stalled / busy) and the activity tracker."""

from __future__ import annotations

import json
from pathlib import Path

from ddpdoctor.analysis import diagnose
from ddpdoctor.analysis.hung.proof import CONFIRM_S, Activity, is_hang, judge
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.supervisor.activity import ActivityTracker
from ddpdoctor.supervisor.waits import WaitNotes
from ddpdoctor.trace.reader import load_run
from ddpdoctor.trace.stacktext import runs_own_code

NOW = 100.0


def st(rank: int, name: str | None = None, op: str = "", seq: int = 7, since: float = 2.0, **kw) -> dict:
    phase = None
    if name:
        phase = {"name": name, "op": op, "seq": seq, "since_s": since, "group": "WORLD", "bytes": 0}
        phase.update(kw.pop("phase", {}))
    return {"rank": rank, "pid": 10 + rank, "heartbeat_wall": NOW, "phase": phase, "step": 3, "seq": seq} | kw


def busy(idle: float = 0.2, frame: str = "evaluate() train.py:27") -> Activity:
    return Activity(True, idle, 0.9, frame)


def test_ops_that_differ_at_one_sequence_number_are_proven() -> None:
    v = judge({0: st(0, "sync_buffers", "broadcast"), 1: st(1, "collective", "barrier")}, {}, NOW)
    assert v.state == "proven" and v.culprits == [0]
    assert v.proof == "ranks disagree on the op of collective #7: rank(s) 0 broadcast vs rank(s) 1 barrier"


def test_sizes_that_differ_are_proven_but_object_ops_are_not() -> None:
    a = st(0, "collective", "all_reduce", phase={"bytes": 16})
    b = st(1, "collective", "all_reduce", phase={"bytes": 32})
    v = judge({0: a, 1: b}, {}, NOW)
    assert v.state == "proven" and "all_reduce's size at collective #7" in v.proof and "16 bytes" in v.proof
    a = st(0, "collective", "all_gather_object", phase={"bytes": 16})
    b = st(1, "collective", "all_gather_object", phase={"bytes": 32})
    assert judge({0: a, 1: b}, {}, NOW).state == "blocked"


def sig(rank: int, op: str, **fields) -> dict:
    base = {"dtype": "float32", "numel": 4, "root": -1, "ranks": "", "bytes": 16}
    return st(rank, "collective", op, phase=base | fields)


def test_every_part_of_the_signature_is_compared_and_named() -> None:
    v = judge({0: sig(0, "broadcast", root=0), 1: sig(1, "broadcast", root=1)}, {}, NOW)
    assert v.state == "proven"
    assert v.proof == "ranks disagree on the broadcast's src at collective #7: rank 0 src=0, rank 1 src=1"
    v = judge({0: sig(0, "all_reduce"), 1: sig(1, "all_reduce", dtype="float64", bytes=32)}, {}, NOW)
    assert v.state == "proven" and "all_reduce's dtype" in v.proof and "rank 1 float64" in v.proof
    v = judge({0: sig(0, "all_reduce", numel=4), 1: sig(1, "all_reduce", numel=5, bytes=20)}, {}, NOW)
    assert "element count" in v.proof and "rank 1 5 elements" in v.proof
    same = {r: sig(r, "broadcast", root=0) for r in (0, 1)}
    assert judge(same, {}, NOW).state == "blocked", "one signature on every rank: nothing proven"


def test_a_new_group_that_only_some_ranks_create_is_named() -> None:
    ng = st(0, "collective", "new_group", phase={"dtype": "", "numel": 0, "root": -1, "ranks": "0 1"})
    v = judge({0: ng, 1: sig(1, "all_reduce")}, {}, NOW)
    assert v.state == "proven" and v.culprits == [0]
    assert "rank(s) 0 create a process group (new_group) that rank(s) 1 do not" in v.proof


def test_a_rank_in_the_ddp_constructor_waits_for_its_group() -> None:
    # DDP's constructor is a collective of its group (shape check, state broadcast), from C++:
    # a rank idle there waits, and a new_group the others never create at that number is
    # proven, not mistaken for a rank busy in user code.
    ng = st(0, "collective", "new_group", seq=0, phase={"ranks": "0 1"})
    init = st(1, "ddp_init", "init", seq=0)
    v = judge({0: ng, 1: init}, {1: Activity(True, 2.0, 0.0)}, NOW)
    assert v.state == "proven" and v.culprits == [0], v
    assert "(they are in DDP constructor at collective #0)" in v.proof
    # It also computes (the reducer's set-up, on a loaded machine for seconds): while its CPU
    # moves, the ranks in it are not waiting, and nothing is proven or blocked.
    both = {r: st(r, "ddp_init", "init", seq=0) for r in (0, 1)}
    assert judge(both, {0: busy(), 1: busy()}, NOW).state == "running"
    # Its number is where it began: a rank still receiving the broadcast while another went on
    # to the next collective is not proven behind.
    ahead = st(0, "collective", "barrier", seq=2)
    assert judge({0: ahead, 1: st(1, "ddp_init", "init", seq=0)}, {}, NOW).state != "proven"


def test_ranks_at_different_sequence_numbers_are_proven() -> None:
    v = judge({0: st(0, "collective", "barrier", seq=10), 1: st(1, "collective", "barrier", seq=11)}, {}, NOW)
    assert v.state == "proven" and v.culprits == [0] and "different collectives" in v.proof


def test_a_passing_overlap_is_not_a_proof() -> None:
    # Rank 1 already waits in #11 while rank 0 has not yet returned from #10: for a moment only.
    young = {0: st(0, "collective", "barrier", seq=10, since=0.3), 1: st(1, "collective", "barrier", seq=11)}
    assert judge(young, {}, NOW).state != "proven"
    stale = {0: st(0, "collective", "barrier", seq=10) | {"heartbeat_wall": NOW - 5}}
    stale[1] = st(1, "collective", "barrier", seq=11)
    assert judge(stale, {}, NOW).state != "proven", "a status 5 s old says nothing about now"
    assert CONFIRM_S <= 2.0, "the proof must still come within 3 s of the stall"


def test_a_rank_that_left_while_others_wait_is_proven_unless_it_joined() -> None:
    gone = st(1, None, seq=7) | {"exited": True}
    v = judge({0: st(0, "collective", "all_reduce"), 1: gone}, {}, NOW)
    assert v.state == "proven" and v.culprits == [1]
    assert v.proof.startswith("rank 1 exited (after step 3) while rank(s) 0 wait in all_reduce #7")
    joined = st(1, None, seq=8) | {"exited": True}  # it issued #7 before leaving
    assert judge({0: st(0, "collective", "all_reduce"), 1: joined}, {}, NOW).state == "running"
    # CI saw it at a job's close: rank 0, busy before the DDP constructor, then finished its
    # three steps and exited while rank 1's last status (a quarter second old) still showed the
    # constructor's wait of 8 s: its wait had ended, not "every live rank blocked".
    done = st(0, None, seq=8) | {"exited": True}
    late = st(1, "ddp_init", "init", seq=0, since=8.1)
    assert judge({0: done, 1: late}, {1: Activity(True, 8.0, 0.0)}, NOW, world_size=2).state == "running"
    died = st(1, "backward", "allreduce", seq=5)
    v = judge({0: st(0, "collective", "all_reduce"), 1: died}, {1: Activity(alive=False)}, NOW)
    assert v.state == "proven" and v.proof.startswith("rank 1 died")


def test_subgroups_are_judged_apart_and_outsiders_never_block_them() -> None:
    sub = {"group": "pg1", "group_ranks": [0, 1]}
    statuses = {
        0: st(0, "collective", "all_reduce", seq=3, phase=sub),
        1: st(1, "collective", "all_reduce", seq=3, phase=sub),
        2: st(2, None, seq=9) | {"exited": True},
    }
    assert judge(statuses, {}, NOW, world_size=3).state == "blocked", "rank 2 is no member of pg1"
    statuses[1] = st(1, "collective", "broadcast", seq=3, phase=sub)
    v = judge(statuses, {}, NOW, world_size=3)
    assert v.state == "proven" and "of group pg1" in v.proof


def test_ddp_backward_waits_only_when_its_cpu_is_idle() -> None:
    statuses = {0: st(0, "backward", "allreduce"), 1: st(1, "collective", "barrier")}
    slow_step = judge(statuses, {0: busy()}, NOW)
    assert slow_step.state == "busy", "computing gradients: progressing"
    assert not slow_step.rank_only, "a slow training step is a straggler, not rank-only work"
    v = judge(statuses, {0: Activity(True, 2.0, 0.0)}, NOW)
    assert v.state == "proven" and "rank(s) 0 allreduce vs rank(s) 1 barrier" in v.proof
    fwd = {0: st(0, "forward", "train"), 1: st(1, "collective", "barrier")}
    assert judge(fwd, {0: Activity(True, 2.0, 0.0)}, NOW).state == "blocked", "forward's op is unknown"


TORCH = "/venv/lib/python3.11/site-packages/torch"
PROBE = "/venv/lib/python3.11/site-packages/ddpdoctor/probes/ddp.py"


def frames(*files: str) -> list[dict]:
    """A main thread's frames, innermost first, from their files."""
    return [{"file": f, "line": i + 1, "function": f"f{i}"} for i, f in enumerate(files)]


def test_own_code_inside_a_ddp_pass_is_told_from_a_wait_for_peers() -> None:
    engine = (f"{TORCH}/autograd/graph.py", f"{TORCH}/autograd/__init__.py", PROBE, "/home/u/train.py")
    # A custom autograd Function's backward that sleeps: the user's code, inside the backward.
    assert runs_own_code(frames("/home/u/ops.py", f"{TORCH}/autograd/function.py", *engine))
    # Waiting in the reducer: no user frame inside the pass.
    assert not runs_own_code(frames(*engine))
    # A Python comm hook waiting on its all-reduce's future, or a collective the hook issued
    # (its probe's frame): waits for peers, inside the user's hook.
    assert not runs_own_code(frames(f"{TORCH}/futures/__init__.py", "/home/u/hooks.py", *engine))
    assert not runs_own_code(frames(PROBE, f"{TORCH}/distributed/c10d.py", "/home/u/hooks.py", *engine))
    # A device synchronisation in a hook may wait on an NCCL kernel that waits for a peer.
    assert not runs_own_code(frames(f"{TORCH}/cuda/__init__.py", "/home/u/hooks.py", *engine))
    # A lock in the user's code: the standard library's frames inside it do not wait for peers.
    assert runs_own_code(frames("/usr/lib/python3.11/threading.py", "/home/u/cache.py", *engine))
    # User code with no probe around it (a stack `attach` took): no pass to be inside of.
    assert not runs_own_code(frames("/home/u/train.py", "/home/u/train.py"))


def test_a_rank_blocked_in_its_own_code_inside_its_backward_is_stalled_not_waiting() -> None:
    statuses = {0: st(0, "backward", "allreduce"), 1: st(1, "backward", "allreduce")}
    idle = Activity(True, 4.0, 0.0, "f0() train.py:1")
    v = judge(statuses, {0: idle, 1: idle}, NOW)
    assert v.state == "blocked" and v.culprits == [0, 1], "both idle in the reducer: nothing says who"
    v = judge(statuses, {0: Activity(True, 4.0, 0.0, "load() cache.py:9", own_code=True), 1: idle}, NOW)
    assert v.state == "stalled" and v.culprits == [0] and v.waiting == [1]
    assert v.proof.startswith("rank 0 makes no progress in its own code inside its DDP backward (load()")
    assert is_hang(v, 3.0, hang_timeout=None, longest=4.0, quiet=4.0, started=True)


def test_the_tracker_reads_the_stacks_of_idle_ranks_in_a_ddp_pass_once_none_is_elsewhere() -> None:
    engine = (f"{TORCH}/autograd/__init__.py", PROBE, "/home/u/train.py")
    stacks = {10: frames("/home/u/ops.py", *engine), 11: frames(*engine)}

    def dump(pid: int) -> dict:
        return {"method": "py-spy", "threads": [{"name": "MainThread", "frames": stacks[pid]}]}

    tr = ActivityTracker(dump=dump, cpu=lambda pid: 1.0, spawn=lambda work: work())
    statuses = {r: RankStatus.of(st(r, "backward", "allreduce")) for r in (0, 1)}
    for t in (0.0, 1.0, 2.0, 3.0, 4.0):
        acts = tr.look(statuses, t, {0, 1}, {0: True, 1: True}, since={0: 0.0, 1: 0.0})
    assert acts[0].own_code and acts[0].frame == "f0() ops.py:1"
    assert not acts[1].own_code and acts[1].frame == "f2() train.py:3"
    tr.forget()
    statuses[1] = RankStatus.of(st(1))  # a rank outside every sync point: its stack is the question
    for t in (10.0, 11.0, 12.0, 13.0, 14.0):
        acts = tr.look(statuses, t, {0, 1}, {0: True, 1: True}, since={0: 10.0, 1: 10.0})
    assert acts[0].frame is None and acts[1].frame == "f2() train.py:3"


def test_waiting_on_a_busy_rank_is_not_a_hang_and_names_where_it_is() -> None:
    v = judge({0: st(0), 1: st(1, "collective", "barrier", since=40)}, {0: busy()}, NOW)
    assert v.state == "busy" and v.culprits == [0] and v.waiting == [1] and v.wait_s == 40 and v.rank_only
    assert v.proof == "rank(s) 1 wait in barrier #7 for busy rank 0 in evaluate() train.py:27"


def test_a_busy_rank_before_its_first_step_is_placed_in_words() -> None:
    statuses = {0: st(0) | {"step": -1}, 1: st(1, "ddp_init", "init", seq=0, since=5)}
    v = judge(statuses, {0: busy(frame=""), 1: Activity(True, 2.0, 0.0)}, NOW)
    assert v.state == "busy" and v.culprits == [0]
    assert "user code before step 0" in v.proof and "step -1" not in v.proof


def test_a_rank_that_does_not_move_is_stalled_and_unmeasured_ranks_say_so() -> None:
    idle = Activity(True, 31.0, 0.0, "wait() train.py:9")
    v = judge({0: st(0), 1: st(1, "collective", "barrier", since=31)}, {0: idle}, NOW)
    assert v.state == "stalled" and v.culprits == [0] and v.idle_s == 31.0
    assert judge({0: st(0), 1: st(1, "collective", "barrier")}, {}, NOW).state == "unmeasured"
    assert judge({0: st(0), 1: st(1)}, {0: idle, 1: idle}, NOW).state == "quiet"
    assert judge({0: st(0), 1: st(1)}, {0: busy(), 1: idle}, NOW).state == "running"


def test_a_measurement_under_way_is_waited_for_not_replaced_by_the_clock() -> None:
    """The tracker knows a rank's CPU only a window after it starts measuring; until then the
    rank is unknown for a second, not unmeasurable, and a 3 s clock must not call it a hang."""
    statuses = {0: st(0) | {"step": -1}, 1: st(1, "ddp_init", "init", seq=0, since=4)}
    pending = {0: Activity(pending=True), 1: Activity(pending=True)}
    v = judge(statuses, pending, NOW)
    assert v.state == "running"
    assert not is_hang(v, 3.0, hang_timeout=None, longest=4.0, quiet=4.0, started=False)
    assert judge(statuses, {0: Activity(), 1: Activity()}, NOW).state == "unmeasured", "never measured"
    known = judge(statuses, {0: busy(), 1: Activity(True, 4.0, 0.0)}, NOW)
    assert known.state == "busy" and known.culprits == [0] and known.waiting == [1]


def test_a_rank_never_heard_from_blocks_every_proof_and_is_named_once_all_others_wait() -> None:
    """A node lost before its doctor first reported (or one run without a doctor): its ranks
    have no status. Nothing about them can be proven, but once every rank heard from waits, the
    silent ones are what they wait for: the clock decides, as for a rank not measured."""
    statuses = {0: st(0, "collective", "barrier", seq=10), 1: st(1, "collective", "barrier", seq=11)}
    v = judge(statuses, {}, NOW, world_size=4)
    assert v.state == "unmeasured" and v.culprits == [2, 3] and v.waiting == [0, 1]
    assert v.proof.startswith("rank(s) 2-3 never reported") and "wait in barrier #10, barrier #11" in v.proof
    assert v.where[2] == "never reported"
    kw = {"hang_timeout": None, "quiet": 0.0, "started": True}
    assert not is_hang(v, 5.0, longest=2.0, **kw) and is_hang(v, 5.0, longest=6.0, **kw)
    # a rank heard from still works: nothing to say about the silent ones yet
    working = {0: st(0, "collective", "barrier", seq=10), 1: st(1)}
    assert judge(working, {1: busy()}, NOW, world_size=3).state == "running"
    assert judge({}, {}, NOW, world_size=2).state == "running"


def test_tracker_tells_cpu_work_and_changing_stacks_from_a_frozen_rank() -> None:
    cpu = {10: 0.0, 11: 0.0}
    stacks = {10: "a", 11: "same"}

    def dump(pid: int) -> dict:
        frames = [{"file": "/home/u/train.py", "line": 5, "function": stacks[pid]}]
        return {"method": "py-spy", "threads": [{"name": "MainThread", "frames": frames}]}

    tr = ActivityTracker(dump=dump, cpu=lambda pid: cpu[pid], spawn=lambda work: work())
    statuses = {0: RankStatus.of(st(0)), 1: RankStatus.of(st(1))}
    alive = {0: True, 1: True}
    first = tr.look(statuses, 0.0, {0, 1}, alive, since={0: 0.0, 1: 0.0})
    assert first[0].idle_s is None and first[0].pending, "one window must pass before anything is known"
    for t in (1.0, 2.0, 3.0, 4.0):
        cpu[10] += 0.0  # rank 0: no CPU, but a new stack each sample (a sleeping poll loop that moves)
        cpu[11] += 0.001
        stacks[10] = f"f{t}"
        acts = tr.look(statuses, t, {0, 1}, alive)
    assert acts[0].idle_s is not None and acts[0].idle_s <= 2.0, "its stack changed"
    assert acts[1].idle_s == 4.0 and acts[1].frame == "same() train.py:5", "frozen since its last event"
    cpu[11] += 0.9
    assert tr.look(statuses, 5.0, {0, 1}, alive)[1].idle_s == 0.0, "CPU work is progress"


def test_a_slow_stack_sample_never_holds_up_a_look_and_counts_from_when_it_was_asked() -> None:
    """On a loaded host a py-spy dump takes seconds; the look goes on without it (the watcher
    must keep reading fresh statuses) and reads the stack at a later look."""
    queued: list = []
    stack = ["poll"]

    def dump(pid: int) -> dict:
        frames = [{"file": "/home/u/train.py", "line": 7, "function": stack[0]}]
        return {"method": "py-spy", "threads": [{"name": "MainThread", "frames": frames}]}

    tr = ActivityTracker(dump=dump, cpu=lambda pid: 0.0, spawn=queued.append)
    statuses, alive = {0: RankStatus.of(st(0))}, {0: True}
    tr.look(statuses, 10.0, {0}, alive, since={0: 10.0})
    assert len(queued) == 1, "asked for, not waited on"
    tr.look(statuses, 11.0, {0}, alive)
    queued.pop()()  # the first sample comes back late
    assert tr.look(statuses, 12.0, {0}, alive)[0].frame == "poll() train.py:7"
    assert len(queued) == 1  # the next one, asked for at 12.0
    stack[0] = "retry"
    assert tr.look(statuses, 13.0, {0}, alive)[0].idle_s == 3.0, "still out: nothing new yet"
    queued.pop()()
    acts = tr.look(statuses, 13.5, {0}, alive)
    assert acts[0].idle_s == 1.5 and acts[0].frame == "retry() train.py:7", "moved by 12.0, when asked"


def test_a_rank_busy_at_the_first_look_that_then_waits_is_a_waiting_rank(tmp_path: Path) -> None:
    """Rank 2 was between sync points at the episode's first look and joined the wait at the
    next: the episode is ranks 1-2 waiting for rank 0, not rank-only work by ranks 0 and 2."""
    notes = WaitNotes(tmp_path)
    first = judge(
        {0: st(0), 1: st(1, "collective", "barrier", seq=15, since=5), 2: st(2)}, {0: busy(), 2: busy()}, NOW
    )
    notes.update(first, NOW, threshold=60.0, report=lambda _: None)
    assert notes.current is not None and notes.current["busy"] == [0, 2]
    statuses = {
        0: st(0),
        1: st(1, "collective", "barrier", seq=15, since=6),
        2: st(2, "collective", "barrier", seq=15),
    }
    notes.update(judge(statuses, {0: busy()}, NOW + 1), NOW + 1, threshold=60.0, report=lambda _: None)
    assert (notes.current["waiting"], notes.current["busy"]) == ([1, 2], [0])
    assert set(notes.current["phases"]) == {"1", "2"}


def test_wait_notes_live_file_episode_and_the_final_finding(tmp_path: Path) -> None:
    lines = []
    notes = WaitNotes(tmp_path)
    slow_step = judge(
        {0: st(0, "backward", "allreduce"), 1: st(1, "collective", "barrier")}, {0: busy()}, NOW
    )
    notes.update(slow_step, NOW, threshold=1.0, report=lines.append)
    assert notes.current is None and not lines, "stragglers are the straggler finding's business"
    statuses = {0: st(0), 1: st(1, "collective", "barrier", seq=15, since=5)}
    v = judge(statuses, {0: busy()}, NOW)
    notes.update(v, NOW, threshold=4.0, report=lines.append)
    live = json.loads((tmp_path / "waiting.json").read_text())
    assert live["waiting"] == [1] and live["busy"] == [0] and live["where"]["0"].startswith("evaluate()")
    assert lines == ["ddpdoctor: not a hang: " + v.proof + " (5 s so far)"]
    notes.update(judge({0: st(0), 1: st(1)}, {0: busy(), 1: busy()}, NOW + 35), NOW + 35, 4.0, lines.append)
    assert not (tmp_path / "waiting.json").exists() and notes.episodes[0]["wait_s"] == 40.0
    header = {"schema": "ddpdoctor.trace/1", "rank": 1, "world_size": 2, "wall_ns": 0, "mono_ns": 0}
    trace = [["header", header], ["collective", 10, 40_100_000, 3, "barrier", 0, "WORLD", 2, 15, 0]]
    trace.append(["end", 40_200_000, 0, 3, {"reason": "exit"}])
    (tmp_path / "trace-rank1.jsonl").write_text("\n".join(json.dumps(x) for x in trace) + "\n")
    (tmp_path / "run.json").write_text(json.dumps({"exit_code": 0}))
    (tmp_path / "watch.json").write_text(json.dumps({"waits": notes.episodes}))
    [f] = [f for f in diagnose(load_run([tmp_path])).findings if f.kind == "rank_only_work"]
    assert f.summary == "rank(s) 1 idled 40.1 s at barrier #15 while rank(s) 0 ran evaluate() train.py:27"
    assert f.fix.startswith("Spread evaluation over every rank with a DistributedSampler")
