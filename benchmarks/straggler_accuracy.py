"""How often does ddpdoctor name the right straggler rank and phase?

Simulated trials inject a delay into a random rank and phase (ddpdoctor.trace.simulate) at
several fractions of the step time, with random world sizes and jitter; `--real N` also runs
N real 3-rank torchrun jobs with a random slow rank and phase. Target: 100 % for delays of at
least 10 % of the step time.

    python benchmarks/straggler_accuracy.py [--trials 200] [--real 4]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from ddpdoctor.analysis import diagnose
from ddpdoctor.trace.simulate import BASE_MS, Slowdown, simulate_run

PHASES = list(BASE_MS)
JOB = Path(__file__).resolve().parent.parent / "tests" / "jobs" / "straggler.py"


def simulated(trials: int, fraction: float, seed: int) -> tuple[int, int, int]:
    """(right rank and phase, right rank only, false alarms on a healthy twin run)."""
    rng = random.Random(seed)
    both = rank_only = false = 0
    for t in range(trials):
        world = rng.choice([2, 4, 8, 16])
        jitter = rng.uniform(0.02, 0.08)
        rank, phase = rng.randrange(world), rng.choice(PHASES)
        step = sum(BASE_MS.values())
        run = simulate_run(
            world, 40, slow=Slowdown(rank, phase, fraction * step), jitter=jitter, seed=seed * 100_000 + t
        )
        found = [f for f in diagnose(run).findings if f.kind == "straggler"]
        if found and found[0].ranks == [rank]:
            rank_only += 1
            both += found[0].details["phase"] == phase
        healthy = simulate_run(world, 40, jitter=jitter, seed=seed * 100_000 + t)
        false += any(f.kind == "straggler" for f in diagnose(healthy).findings)
    return both, rank_only, false


def real(runs: int, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    right = 0
    for _ in range(runs):
        rank, kind = rng.randrange(3), rng.choice(["data", "forward", "other"])
        phase = {"data": "data_wait", "forward": "forward", "other": "other"}[kind]
        out = Path(tempfile.mkdtemp()) / "run"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "ddpdoctor",
                "run",
                "--out",
                str(out),
                "--",
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=3",
                str(JOB),
                kind,
                "15",
                f"--slow={rank}",
            ],
            capture_output=True,
            timeout=300,
            check=True,
        )
        diag = json.loads(
            subprocess.run(
                [sys.executable, "-m", "ddpdoctor", "diagnose", "--json", str(out)],
                capture_output=True,
                text=True,
            ).stdout
        )
        found = [f for f in diag["findings"] if f["kind"] == "straggler"]
        ok = bool(found) and found[0]["ranks"] == [rank] and found[0]["details"]["phase"] == phase
        right += ok
        print(f"  real: slow rank {rank} in {phase}: {'right' if ok else 'WRONG: ' + str(found)[:200]}")
    return right, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--real", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"simulated: {args.trials} trials per delay, world 2-16, jitter 2-8 % per phase")
    for fraction in (0.05, 0.10, 0.20, 0.50):
        both, rank_only, false = simulated(args.trials, fraction, args.seed)
        print(
            f"  delay {fraction:4.0%} of step: rank+phase {both / args.trials:6.1%}, "
            f"rank {rank_only / args.trials:6.1%}, false alarms on healthy twins "
            f"{false}/{args.trials}"
        )
    if args.real:
        right, runs = real(args.real, args.seed)
        print(f"real 3-rank torchrun jobs (15 ms delay): {right}/{runs} right rank and phase")


if __name__ == "__main__":
    main()
