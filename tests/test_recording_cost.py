"""What the cheap recording path keeps per call site must never change what is recorded: a
collective's bytes and signature follow its tensor from call to call on one line, and a call
made from inside a library is placed at each of its own callers. A real one-rank gloo process
group in a subprocess (the probes patch torch, so never in the test process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import job_env, read_lines

JOB = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], DDPDOCTOR_RUN_DIR=sys.argv[2])
import ddpdoctor.probes as probes
probes.install()
import torch, torch.distributed as dist
from ddpdoctor.probes import callsite
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
try:
    dist.broadcast(torch.ones(3), src=5)  # RAISES_LINE: no rank 5 in a world of one
except Exception as exc:
    print("raised:", type(exc).__name__)
else:
    raise SystemExit("broadcast from a missing rank did not raise")
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


def test_a_loop_line_and_a_library_helper_record_each_call_as_it_was(tmp_path: Path) -> None:
    from conftest import free_port

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "fakelib.py").write_text(LIB)
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(script), str(free_port()), str(run_dir), str(lib)]
    proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]

    records = read_lines(run_dir / "trace-rank0.jsonl")
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

    helper = [(sites[r[10]], sigs[r[11]]["dtype"]) for r in calls if r not in loop + asynchronous]
    first, second, third = (_line(JOB, f"{n}_CALLER") for n in ("FIRST", "SECOND", "THIRD"))
    assert helper == [(first, "float32"), (second, "float32"), (third, "float64")] * 3

    # A call that raised is a ``raised`` record naming its whole signature, never a span.
    raised = [r[4] for r in records if r[0] == "raised"]
    assert [(x["kind"], x["fields"][0], x["fields"][1]) for x in raised] == [("collective", "broadcast", 12)]
    assert sites[raised[0]["fields"][6]] == _line(JOB, "RAISES_LINE")
    assert not [r for r in records if r[0] == "collective" and r[4] == "broadcast"]

    end = next(r for r in records if r[0] == "end")[4]
    assert end["reason"] == "exit"
    assert 0 <= end["writer_cpu_s"] <= end["wall_s"] * 2  # the writer thread's own CPU time


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
