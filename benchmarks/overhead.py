"""How much slower is a DDP job under ddpdoctor? Interleaved A/B runs, ratios of step times.

For a compute-bound model (~10M parameters) and a tiny one, run the same 2-rank gloo job
plain, under `ddpdoctor run`, and with torch.profiler (CPU activities), in interleaved order,
and report the median step time of each mode relative to plain. Also reports the trace size
per rank per step, and the per-event cost of a recorded collective measured in-process.

    python benchmarks/overhead.py [--trials 5] [--steps-big 30] [--steps-tiny 400]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = HERE / "overhead_job.py"


def run_once(mode: str, kind: str, steps: int, workdir: Path) -> tuple[float, int]:
    """(median step seconds, trace bytes per rank per step or 0)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(JOB),
        kind,
        str(steps),
    ]
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    if mode == "doctor":
        cmd = [sys.executable, "-m", "ddpdoctor", "run", "--out", str(run_dir), "--", *job]
    elif mode == "profiler":
        cmd = job + ["--profiler"]
    else:
        cmd = job
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}/{kind} failed:\n{proc.stderr[-2000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("{"))
    median = json.loads(line)["median_s"]
    trace_bytes = 0
    if mode == "doctor":
        trace = run_dir / "trace-rank0.jsonl"
        trace_bytes = trace.stat().st_size // (steps + 5)
    return median, trace_bytes


def per_event_cost_us(n: int = 20000) -> dict[str, float]:
    """Cost of recording one collective: patched vs original all_reduce of a 1-element tensor."""
    code = f"""
import os, time, json, tempfile
os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = "29533"
os.environ["DDPDOCTOR_RUN_DIR"] = tempfile.mkdtemp()
import ddpdoctor.probes as probes; probes.install()
import torch, torch.distributed as dist
from ddpdoctor.probes.patching import original
dist.init_process_group("gloo", rank=0, world_size=1)
t = torch.ones(1)
def bench(f):
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range({n}):
            f(t)
        best = min(best, (time.perf_counter() - t0) / {n})
    return best * 1e6
patched = bench(dist.all_reduce); plain = bench(original(dist.all_reduce))
print(json.dumps({{"plain_us": plain, "recorded_us": patched, "overhead_us": patched - plain}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps-big", type=int, default=30)
    parser.add_argument("--steps-tiny", type=int, default=400)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ddpdoctor-overhead-"))
    modes = ["plain", "doctor", "profiler"]
    print(f"per-event cost: {json.dumps(per_event_cost_us())}")
    for kind, steps in (("big", args.steps_big), ("tiny", args.steps_tiny)):
        results: dict[str, list[float]] = {m: [] for m in modes}
        sizes: list[int] = []
        t0 = time.time()
        for trial in range(args.trials):
            order = modes[:]
            random.Random(trial).shuffle(order)
            for mode in order:
                median, size = run_once(mode, kind, steps, workdir)
                results[mode].append(median)
                if size:
                    sizes.append(size)
        base = statistics.median(results["plain"])
        print(f"\n{kind} model, {steps} steps x {args.trials} interleaved trials ({time.time() - t0:.0f} s):")
        for mode in modes:
            med = statistics.median(results[mode])
            print(
                f"  {mode:9s} median step {med * 1e3:8.2f} ms   ratio to plain {med / base:6.3f}"
                f"   trials: {', '.join(f'{v * 1e3:.2f}' for v in results[mode])}"
            )
        print(f"  trace: {statistics.median(sizes)} bytes per rank per step")


if __name__ == "__main__":
    main()
