"""What the cheap recording path keeps per call site must never change what is recorded: a
collective's bytes and signature follow its tensor from call to call on one line, and a call
made from inside a library is placed at each of its own callers. Both recording paths, the C
module's (``probes/_fast.c``, a call site seen before) and Python's, record the same. A real
one-rank gloo process group in a subprocess (the probes patch torch, so never in the test
process)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, job_env, read_lines

JOB = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], DDPDOCTOR_RUN_DIR=sys.argv[2])
import ddpdoctor.probes as probes
from ddpdoctor.probes import fastpath
if sys.argv[4] == "refused":  # the C wrapper cannot be made: the Python one, called directly
    def refuse(*args, **kwargs):
        raise ValueError("a record layout the C path does not know")
    fastpath.collective = refuse
probes.install()
claims = [0]  # slots of the C module's ring claimed by Python code (RingSeqs.next)
def count_claims(frame, event, arg):
    if event == "c_call" and type(getattr(arg, "__self__", None)).__name__ == "RingSeqs":
        claims[0] += arg.__name__ == "next"  # the writer's take is no claim
sys.setprofile(count_claims)
import torch, torch.distributed as dist
from ddpdoctor.probes import callsite
print("c path:", fastpath.module() is not None)
dist.init_process_group("gloo", rank=0, world_size=1)
lib_dir = sys.argv[3]
callsite._skip = callsite._prefixes() + (lib_dir + os.sep,)  # frames there are not the user's
sys.path.insert(0, lib_dir)
import fakelib
for n in (1, 4, 1, 4, 16):
    dist.all_reduce(torch.ones(n))  # LOOP_LINE
for k in range(3):
    fakelib.sync(torch.ones(2))  # FIRST_CALLER
    fakelib.sync(torch.ones(2))  # SECOND_CALLER
    fakelib.sync(torch.ones(2, dtype=torch.float64))  # THIRD_CALLER
for _ in range(2):
    dist.all_reduce(torch.ones(3), async_op=True).wait()  # ASYNC_LINE
for _ in range(2):
    try:
        dist.broadcast(torch.ones(3), src=5)  # RAISES_LINE: no rank 5 in a world of one
    except Exception as exc:
        print("raised:", type(exc).__name__)
    else:
        raise SystemExit("broadcast from a missing rank did not raise")
for _ in range(3):
    dist.all_reduce(torch.ones(2, dtype=torch.int64) * 2**40)  # BIG_LINE
    dist.broadcast(torch.ones(2), 0)  # ROOT_LINE
    dist.all_reduce(torch.ones(2), group=None, op=dist.ReduceOp.SUM)  # KEYWORD_LINE
for flag in (False, False, True, True, False):  # torch.export's tracing sets it: torch's call alone
    torch.compiler._is_compiling_flag = flag
    dist.all_reduce(torch.ones(5))  # EXPORT_LINE: known to the C path from its second call
torch.compiler._is_compiling_flag = False
from ddpdoctor.probes import collector
collector.ACTIVE.step = 2**33  # a value its field cannot hold: the slot is voided, not left unwritten
for _ in range(2):
    dist.all_reduce(torch.ones(1))  # ODD_LINE
collector.ACTIVE.step = -1
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(2, 2))
with torch.no_grad():
    for _ in range(3):
        model(torch.ones(1, 2))  # FORWARD_LINE: called through nn.Module's frames; found in C once learnt
    for i in range(4):  # two lines in turn: each call's own site, never the one before's
        if i % 2:
            model(torch.ones(1, 2))  # ODD_FORWARD
        else:
            model(torch.ones(1, 2))  # EVEN_FORWARD
class Peek(torch.nn.Module):  # what the live status reads while a forward runs, and after a collective in it
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
    def forward(self, x):
        seen = collector.ACTIVE.progress
        dist.all_reduce(torch.ones(1))  # NESTED_LINE: in C from its second call
        again = collector.ACTIVE.progress
        print("inside:", seen == again, getattr(seen[0], "value", None), seen[1:3], len(seen), seen[4:7])
        return self.lin(x)
peek = DDP(Peek())
with torch.no_grad():
    for _ in range(3):
        peek(torch.ones(1, 2))  # PEEK_LINE
print("after:", collector.ACTIVE.progress)
class PeekGrad(torch.autograd.Function):  # and while a backward runs
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        p = collector.ACTIVE.progress
        print("in backward:", getattr(p[0], "value", None), p[1:3], len(p))
        return g
class TwoHeads(torch.nn.Module):  # the second head is used at even steps only
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    def forward(self, x, step):
        return PeekGrad.apply(self.a(x)) + (self.b(x) if step % 2 == 0 else 0)
heads = DDP(TwoHeads())
opt = torch.optim.SGD(heads.parameters(), lr=0.1)
for step in range(2):  # a training step: backward (run-queue read), unused check, optimizer
    opt.zero_grad()
    heads(torch.ones(1, 2), step).sum().backward()  # TRAIN_LINE
    opt.step()
for bad in ("forward", "backward"):  # calls that raise: the patient's error goes on unchanged
    try:
        if bad == "forward":
            heads(torch.ones(1, 2), 0)  # RAISES_FORWARD: DDP's error, step 1 left b without a gradient
        else:
            model(torch.ones(1, 2)).detach().sum().backward()  # RAISES_BACKWARD: nothing requires grad
    except RuntimeError as exc:
        print("raised:", bad, str(exc).splitlines()[0][:50], exc.__traceback__.tb_lineno)
heads.require_backward_grad_sync = True  # the unused head would make DDP raise at a third forward
print("after all:", collector.ACTIVE.progress)
from ddpdoctor.probes import ddp, optimizer
print("recorded in C:", {k: p.recorded for k, p in sorted(ddp.IN_C.items())})
print("optimizer steps in C:", {k: p.recorded for k, p in sorted(optimizer.IN_C.items())})
from ddpdoctor.probes import native
print("C++ timer:", native.module() is not None)
sys.setprofile(None)
print("slots claimed in Python:", claims[0])  # its reader gives the C probes sequence numbers
active, collector.ACTIVE = collector.ACTIVE, None  # no collector (as in a forked child): calls pass through
before = sys.getrefcount(None)
with torch.no_grad():
    for _ in range(5000):
        model(torch.ones(1, 2))
print("None's count moved by:", sys.getrefcount(None) - before)
collector.ACTIVE = active
dist.barrier()
dist.destroy_process_group()
"""
LIB = """
import torch.distributed as dist

def sync(t):
    dist.all_reduce(t)
"""


def _line(source: str, marker: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if marker in text)


def _events(records: list[list]) -> list[list]:
    """The records but their times (t0, duration, a raised call's), the end record's
    measurements and the directory of each site's file. The count of dropped events is
    written when the writer thread next flushes: its total goes last, not where it fell."""
    out, dropped = [], 0
    for r in records:
        if r[0] == "site":
            r = [*r[:4], dict(r[4], file=Path(r[4]["file"]).name)]
        if r[0] == "raised":
            r = [*r[:4], dict(r[4], dur_us=0)]
            if r[4]["kind"] == "backward":  # its run-queue delay
                r[4]["fields"] = [v >= 0 for v in r[4]["fields"]]
        if r[0] == "backward":  # the run-queue delay so far: known, not equal from run to run
            r = [*r[:4], r[4] >= 0]
        if r[0] == "comm_hook":  # which timer timed the buckets (C++ where built, or Python)
            r = [*r[:4], {k: v for k, v in r[4].items() if k != "native"}]
        if r[0] == "dropped":
            dropped = r[4]["count"]
        elif r[0] not in ("end", "header", "clock"):
            out.append([r[0], *r[3:]])
    return [*out, ["dropped", dropped]]


@pytest.fixture(scope="module")
def pure_python_records(tmp_path_factory: pytest.TempPathFactory) -> list[list]:
    return _record(tmp_path_factory.mktemp("python"), "1")


def _record(tmp_path: Path, pure_python: str, mode: str = "") -> list[list]:
    from conftest import free_port

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "fakelib.py").write_text(LIB)
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(script), str(free_port()), str(run_dir), str(lib), mode or "-"]
    # every bucket timed on both paths (``auto`` waits for a step where the Python timer runs)
    env = job_env(DDPDOCTOR_PURE_PYTHON=pure_python, DDPDOCTOR_BUCKET_TIMING="on")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # CI builds the C module (pyproject's ext-modules): its path must be the one measured here
    assert f"c path: {pure_python != '1'}" in proc.stdout, proc.stdout
    # The DDP probes in C took the steady state: each model's first forward and first training
    # forward go to Python (its group is named, its bucket timing decided), and so do the first
    # data.INPUT_SAMPLES training steps' (their inputs are counted); calls that raised are not
    # counted: 2 of the 3 no-grad forwards on one line, 1 of 2 on each of two lines in turn, 2
    # of peek's 3; both backwards.
    in_c = "{'backward': 2, 'forward': 6}" if pure_python != "1" else "{}"
    assert f"recorded in C: {in_c}" in proc.stdout, proc.stdout
    # The live status inside a forward and a backward reads the same on both paths (in C it is
    # built from the probe's parts when read), a recorded collective inside the forward gives
    # the forward's back, and nothing is left behind once the calls return.
    inside = re.findall(r"inside: (.*) forward \('eval', (\d+)\) 8 \('WORLD', 1, -1\)", proc.stdout)
    assert [ok for ok, _ in inside] == ["True"] * 3, proc.stdout
    assert len(re.findall(r"in backward: backward \('allreduce', \d+\) 4", proc.stdout)) == 2, proc.stdout
    assert "after: None" in proc.stdout and "after all: None" in proc.stdout, proc.stdout
    # both optimizer steps were recorded by the C post hook (the pre hook records nothing)
    in_c = "{'post': 2, 'pre': 0}" if pure_python != "1" else "{}"
    assert f"optimizer steps in C: {in_c}" in proc.stdout, proc.stdout
    assert f"C++ timer: {pure_python != '1'}" in proc.stdout, proc.stdout
    # where the C module is loaded, no record is packed by a Python claim of its slot, not even
    # a call site's first, which the Python path records: a signal handler's exception raised
    # between the claim and the pack would leave the slot unwritten (trace/ring.py)
    if pure_python != "1":
        assert "slots claimed in Python: 0" in proc.stdout, proc.stdout
    # a forward with no collector holds and lets go of what it borrowed, never more (the C
    # probe once let go of None each time: a crash once None's count reached zero)
    moved = int(proc.stdout.split("None's count moved by: ")[1].split()[0])
    assert abs(moved) < 100, proc.stdout
    forward, backward = _line(JOB, "RAISES_FORWARD"), _line(JOB, "RAISES_BACKWARD")
    assert f"raised: forward Expected to have finished reduction in the prior i {forward}" in proc.stdout
    assert f"raised: backward element 0 of tensors does not require grad and doe {backward}" in proc.stdout
    return read_lines(run_dir / "trace-rank0.jsonl")


@pytest.mark.parametrize(
    ("pure_python", "mode"), [("0", ""), ("1", ""), ("0", "refused")], ids=["c", "python", "c-refused"]
)
def test_a_loop_line_and_a_library_helper_record_each_call_as_it_was(
    tmp_path: Path, pure_python: str, mode: str, pure_python_records: list[list], native_timer: Path
) -> None:
    records = _record(tmp_path, pure_python, mode)
    sites = {r[4]["id"]: r[4]["line"] for r in records if r[0] == "site"}
    sigs = {r[4]["id"]: r[4] for r in records if r[0] == "signature"}
    calls = [r for r in records if r[0] == "collective" and r[4] == "all_reduce"]
    # fields: op, bytes, group, group_size, seq, async, site, sig
    loop = [r for r in calls if sites[r[10]] == _line(JOB, "LOOP_LINE")]
    asynchronous = [r for r in calls if sites[r[10]] == _line(JOB, "ASYNC_LINE")]
    assert [(r[5], r[9]) for r in asynchronous] == [(12, 1), (12, 1)]
    assert {r[9] for r in calls if r not in asynchronous} == {0}
    assert [r[5] for r in loop] == [4, 16, 4, 16, 64]
    assert [sigs[r[11]]["numel"] for r in loop] == [1, 4, 1, 4, 16]
    assert [r[8] for r in loop] == sorted(r[8] for r in loop)  # the group's own sequence numbers

    first, second, third = (_line(JOB, f"{n}_CALLER") for n in ("FIRST", "SECOND", "THIRD"))
    helper = [(sites[r[10]], sigs[r[11]]["dtype"]) for r in calls if sites[r[10]] in (first, second, third)]
    assert helper == [(first, "float32"), (second, "float32"), (third, "float64")] * 3

    # A call that raised is a ``raised`` record naming its whole signature, never a span.
    raised = [r[4] for r in records if r[0] == "raised" and r[4]["kind"] == "collective"]
    assert [(x["kind"], *x["fields"][:2]) for x in raised] == [("collective", "broadcast", 12)] * 2
    ddp_raised = [(r[4]["kind"], r[4]["fields"]) for r in records if r[0] == "raised" and r[4] not in raised]
    assert ddp_raised[0] == ("forward", [1, 1, ddp_raised[0][1][2], ddp_raised[0][1][3]])
    assert sites[ddp_raised[0][1][3]] == _line(JOB, "RAISES_FORWARD")
    assert [k for k, _ in ddp_raised] == ["forward", "backward"]
    errors = [r[4] for r in records if r[0] == "ddp_error"]  # the parameters DDP's error names
    assert [(e["error"], e["params"]) for e in errors] == [("unfinished_reduction", ["b.weight", "b.bias"])]
    assert {sites[x["fields"][6]] for x in raised} == {_line(JOB, "RAISES_LINE")}
    broadcasts = [r for r in records if r[0] == "collective" and r[4] == "broadcast"]
    assert [(sites[r[10]], sigs[r[11]]["root"]) for r in broadcasts] == [(_line(JOB, "ROOT_LINE"), 0)] * 3
    big = [r[5] for r in calls if sites[r[10]] == _line(JOB, "BIG_LINE")]
    assert big == [16] * 3
    assert len([r for r in calls if sites[r[10]] == _line(JOB, "KEYWORD_LINE")]) == 3
    assert [r[5] for r in calls if sites[r[10]] == _line(JOB, "EXPORT_LINE")] == [20] * 3

    assert not [r for r in calls if sites[r[10]] == _line(JOB, "ODD_LINE")]
    forwards = [r for r in records if r[0] == "forward"]  # fields: grad, training, seq, site
    train_line, no_grad_line = _line(JOB, "TRAIN_LINE"), _line(JOB, "FORWARD_LINE")
    backward_raises = _line(JOB, "RAISES_BACKWARD")  # its forward returned, its backward raised
    in_turn = [_line(JOB, "EVEN_FORWARD"), _line(JOB, "ODD_FORWARD")] * 2
    peek = [_line(JOB, "PEEK_LINE")] * 3
    expected = [no_grad_line] * 3 + in_turn + peek + [train_line] * 2 + [backward_raises]
    assert [sites[r[7]] for r in forwards] == expected
    nested = [r for r in calls if sites[r[10]] == _line(JOB, "NESTED_LINE")]
    assert [r[8] for r in nested] == [r[6] for r in forwards[7:10]]  # each forward's first collective
    assert [r[4] for r in records if r[0] == "collective"][-1] == "barrier"  # recording went on
    train = [r for r in records if r[0] in ("forward", "backward", "optimizer", "unused")][10:-1]
    step = ["forward", "backward", "optimizer"]
    assert [r[0] for r in train] == [*step, *step[:2], "unused", step[2]]
    assert all(r[4] >= 0 for r in train if r[0] == "backward")  # the run-queue delay, read
    assert [r[4]["params"] for r in train if r[0] == "unused"] == [[2, 3]]  # b's weight and bias
    names = {r[4]["id"]: r[4]["value"] for r in records if r[0] == "string"}
    assert [names.get(r[4], r[4]) for r in train if r[0] == "optimizer"] == ["SGD", "SGD"]

    # Both paths record the same events, in the same order, with the same fields.
    assert _events(records) == _events(pure_python_records)

    end = next(r for r in records if r[0] == "end")[4]
    assert end["reason"] == "exit"
    assert 0 <= end["writer_cpu_s"] <= end["wall_s"] * 2  # the writer thread's own CPU time


BROKEN = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], DDPDOCTOR_RUN_DIR=sys.argv[2])
import ddpdoctor.probes as probes
probes.install()
import torch, torch.distributed as dist
from ddpdoctor.probes import collector
dist.init_process_group("gloo", rank=0, world_size=1)
c = collector.ACTIVE

def broken_reader():
    raise RuntimeError("sequence number unreadable")

for i in range(4):
    t = torch.ones(2)
    dist.all_reduce(t)  # the first call describes this site; then its reader breaks
    assert t.tolist() == [1.0, 1.0]
    if i == 0:
        (key, known), = c.calls.items()
        # not a process group, so the C++ timer's reader (where built) leaves it to Python's
        c.calls[key] = (object(), *known[1:10], broken_reader, *known[11:])
print("disabled:", sorted(c.disabled), "events:", c.events)
"""


@pytest.mark.parametrize("pure_python", ["0", "1"], ids=["c", "python"])
def test_a_probe_that_breaks_on_a_known_call_site_switches_off_and_the_call_goes_on(
    tmp_path: Path, pure_python: str
) -> None:
    from conftest import free_port

    script = tmp_path / "job.py"
    script.write_text(BROKEN)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(script), str(free_port()), str(run_dir)]
    proc = subprocess.run(
        cmd, env=job_env(DDPDOCTOR_PURE_PYTHON=pure_python), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "disabled: ['collectives'] events: 1" in proc.stdout, proc.stdout
    log = (run_dir / "probe-errors.log").read_text()
    assert log.count("probe 'collectives' switched off: RuntimeError: sequence number unreadable") == 1, log


def test_the_overhead_benchmark_says_unresolved_when_its_trials_spread_past_the_target() -> None:
    """benchmarks/overhead.py judges issue 25's step ratios from paired trials: met only when
    the whole 95 % interval is within the target, not met when all of it is above."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from overhead import ratio_interval, verdict

    plain = [1.0, 1.3, 0.9, 1.1, 1.2]
    tight = ratio_interval([p * r for p, r in zip(plain, (1.01, 1.012, 1.008, 1.011, 1.009))], plain)
    assert tight is not None and 1.0 < tight[0] < 1.01 < tight[1] < 1.02
    assert verdict(tight, 1.03) is True
    assert verdict(ratio_interval([p * 1.2 for p in plain], plain), 1.03) is False  # all of it above
    spread = ratio_interval([p * r for p, r in zip(plain, (0.9, 1.2, 1.0, 1.1, 0.95))], plain)
    assert spread is not None and verdict(spread, 1.03) is None
    assert ratio_interval([1.0], [1.0]) is None and verdict(None, 1.03) is None


def test_the_overhead_benchmarks_per_event_figures_time_the_paths_they_name() -> None:
    """``overhead.py``'s in-process figures stop where a model meant for the C probe took the
    Python path (as its forward_us check did once every sampled step took it, by design): a
    short run of them goes through every check. What they measure is left to the benchmark."""
    import math

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from overhead import per_event_cost_us

    figures = per_event_cost_us(n=500, pairs=5)
    for key in ("per_event_us", "per_event_cpu_us", "probe_us", "forward_us", "forward_eval_us", "bucket_us"):
        assert math.isfinite(figures[key]), (key, figures)


def test_the_overhead_benchmark_accounts_a_step_by_its_events_and_its_writer_thread() -> None:
    """Where the A/B cannot resolve a 64 ms step, the benchmark adds up its parts: 5 events at
    2 µs and a writer thread at 0.3 % of a core cost a 64 ms step 0.0156 % plus 0.3 %."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from overhead import accounted_ratio

    assert accounted_ratio(5, 2.0, 0.003, 64_000.0) == pytest.approx(1.0 + 10 / 64_000 + 0.003)
    assert accounted_ratio(5, 2.0, 0.0, 1_000.0) == pytest.approx(1.01)  # a tiny step: the events


def test_the_gap_benchmark_times_recorded_and_plain_calls_at_each_gap() -> None:
    """benchmarks/per_event_gap.py runs as documented and prints one JSON object: a row per gap,
    whose plain call takes at least the busy wait before it."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "per_event_gap.py"
    cmd = [sys.executable, str(script), "--gaps", "0", "50", "--rounds", "2", "--calls", "40", "--json"]
    env = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert [row["gap_us"] for row in result["gaps"]] == [0, 50]
    no_gap, gap = result["gaps"]
    assert no_gap["plain_us"] > 0 and gap["plain_us"] >= 50
    assert all(isinstance(row["recorded_minus_plain_cpu_us"], float) for row in result["gaps"])


def test_the_layers_benchmark_times_each_mode_as_it_says() -> None:
    """benchmarks/per_event_layers.py runs as documented, checks each block recorded as its mode
    means (it exits otherwise) and prints one JSON object with a figure per mode."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "per_event_layers.py"
    cmd = [sys.executable, str(script), "--rounds", "2", "--calls", "50", "--json"]
    env = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert set(result) == {"recorded_us", "disabled_us", "off_us", "null_us", "faults_per_call"}
    assert all(isinstance(v, float) for v in result.values())


def test_the_step_benchmark_alternates_its_arms_in_one_two_rank_run_under_the_doctor() -> None:
    """benchmarks/step_cost.py --ranks 2 runs both ranks under ``ddpdoctor run -- torchrun``,
    checks every arm is timed as it says before timing it (it exits otherwise), and prints rank
    0's figures: the default arm's ratio with its interval, and which timer the defaults chose
    (the C++ one on a tiny model's gradients where it is built, else none)."""
    from ddpdoctor.probes import native

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "step_cost.py"
    cmd = [sys.executable, str(script), "--ranks", "2", "--rounds", "2", "--steps", "3", "--json"]
    proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ranks"] == 2 and result["model"] == "tiny"
    built = native.module() is not None
    arms = {"default", "python_timer", "untimed", "builtin_hook"} | ({"cpp_timer"} if built else set())
    assert {k[: -len("_ratio")] for k in result if k.endswith("_ratio")} == arms
    assert result["default_timer"] == ("cpp" if built else "none")  # a 1 ms step can't carry Python's
    low, high = result["default_ratio_ci90"]
    assert result["plain_step_us"] > 0 and low <= result["default_ratio"] <= high


def test_the_step_benchmark_measures_the_recorded_copy_against_itself_unrecorded() -> None:
    """``--arms default,default_off,plain_twin`` on the big model, whose buckets the defaults
    leave untimed: the default arm's own copy in blocks that record nothing (the run exits if
    such a block records), compared round by round as ``default_same``; and a second plain copy
    (A/A). An arm it does not have is refused before any job starts."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "step_cost.py"
    cmd = [sys.executable, str(script), "--ranks", "2", "--model", "big", "--rounds", "2", "--steps", "1"]
    cmd.append("--json")
    proc = subprocess.run(
        [*cmd, "--arms", "default,default_off,plain_twin"],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    arms = {k[: -len("_ratio")] for k in result if k.endswith("_ratio")}
    assert arms == {"default", "default_off", "plain_twin", "default_same"}
    low, high = result["default_same_ratio_ci90"]
    assert low <= result["default_same_ratio"] <= high
    refused = subprocess.run([*cmd, "--arms", "default,warp"], env=job_env(), capture_output=True, text=True)
    assert refused.returncode == 2 and "no arm warp" in refused.stderr


COUNTED_CHILD = """
import sys
case, mode, warmup, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
data = bytes(256 * 1024)  # 4,096 cache lines of 64 bytes, eight times the first-level cache
def extra():
    return sorted(range(50, 0, -1)) if case == "sort" else data.count(1)
def one():
    if mode == "recorded":
        extra()
for _ in range(warmup + n):
    one()
"""


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="benchmarks/instructions.py needs valgrind")
def test_the_instruction_benchmark_counts_what_the_recorded_mode_adds(tmp_path: Path) -> None:
    """benchmarks/instructions.py's counting, on a child whose recorded mode sorts a reversed
    list on every call and whose plain mode does nothing: the instructions added per call are
    the sort's, and the function that does the work heads the list of what was added."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from instructions import measure

    child = tmp_path / "counted.py"
    child.write_text(COUNTED_CHILD)
    few, many = (measure("sort", n, 10, 5, tmp_path, child, False) for n in (50, 200))
    for r in (few, many):
        assert r["plain_instructions"] < r["added_instructions"], r
        assert abs(r["recorded_instructions"] - r["plain_instructions"] - r["added_instructions"]) <= 1
        assert any("sort" in row["function"] for row in r["top"][:3]), r["top"]
    # a cost per call: the same whichever number of calls was counted
    assert abs(few["added_instructions"] - many["added_instructions"]) < 0.05 * many["added_instructions"]


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="benchmarks/instructions.py needs valgrind")
def test_the_instruction_benchmark_counts_the_cache_misses_the_recorded_mode_adds(tmp_path: Path) -> None:
    """With ``--cache``, a recorded mode that reads 256 KiB on every call adds a first-level
    data miss per 64-byte line it reads (4,096), and almost no code misses: its loop is small.
    The scan heads the functions that added instructions."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from instructions import measure

    child = tmp_path / "counted.py"
    child.write_text(COUNTED_CHILD)
    r = measure("scan", 40, 10, 5, tmp_path, child, True)
    assert 4096 * 0.95 < r["added_data_read_misses"] < 4096 * 1.1, r
    assert abs(r["added_code_misses"]) < 50, r
    assert "count" in r["top"][0]["function"], r["top"]  # bytes.count: the scan itself


def test_the_collector_sets_every_field_the_c_probes_read(tmp_path: Path) -> None:
    """A field of ``_fast.State`` the collector never sets reads as NULL in C, and every C probe
    then takes the Python path without a word: each must be set when the collector is made."""
    import time

    from ddpdoctor.probes import collector, fastpath
    from ddpdoctor.trace import schema

    fast = fastpath.module()
    assert fast is not None, "the C module is built wherever the tests run (pyproject's ext-modules)"
    header = {"rank": 0, "world_size": 1, "schema": schema.SCHEMA, "mono_ns": time.monotonic_ns()}
    c = collector.Collector(str(tmp_path), header, None)
    try:
        assert isinstance(c, fast.State)
        kinds = ("member_descriptor", "getset_descriptor")
        fields = [k for k, v in vars(fast.State).items() if type(v).__name__ in kinds and k[0] != "_"]
        assert len(fields) == 23, fields
        assert [k for k in fields if not hasattr(c, k)] == []
        c.step += 1  # Python reads and writes them as attributes
        assert (c.step, c.events, c.progress) == (0, 0, None)
    finally:
        c.close()
