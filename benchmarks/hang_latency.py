"""Seconds from stall to hang verdict, and false alarms, on real jobs at default settings.

    PYTHONPATH=. python benchmarks/hang_latency.py [--trials 3] [--busy-s 40] [--only NAME]
    PYTHONPATH=. python benchmarks/hang_latency.py watch-cost [--ranks 1024]

Every job runs as a user would: `ddpdoctor run --on-hang kill -- torchrun ...` with no
--hang-timeout (the auto threshold: at least 30 s). Hung jobs: the stall begins when the last
rank entered the sync point it stays in (its status: heartbeat - time in phase), the verdict is
the watcher's ``detected_wall``. Healthy jobs whose rank 0 works alone for --busy-s seconds
(longer than the 30 s threshold) while rank 1 waits in a barrier must end with exit 0 and no
hang: any hang is a false alarm.

``watch-cost`` times one look of the watcher (``Watcher.poll_once``) over N simulated ranks'
status files, in the states that cost most (the watcher looks every 0.25 s, or 5x the CPU a
look takes, whichever is longer: at most ~1/5 of a core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "tests" / "jobs"
HUNG = {  # name -> (script, args, expected verdict state)
    "eval0 (op mismatch)": ("faulty_train.py", ["--mode", "eval0"], "proven"),
    "skip_barrier (op mismatch)": ("faulty_train.py", ["--mode", "skip_barrier"], "proven"),
    "sleep outside sync (stall)": ("slow_or_hung.py", ["--mode", "sleep"], "stalled"),
}
SLOW = {
    "rank-0 evaluation": ("slow_or_hung.py", ["--mode", "slow_eval"]),
    "rank-0 checkpoint": ("slow_or_hung.py", ["--mode", "slow_ckpt"]),
}


def run_job(
    script: str, args: list[str], nproc: int = 2
) -> tuple[int, Path, str, tempfile.TemporaryDirectory]:
    tmp = tempfile.TemporaryDirectory()
    run_dir = Path(tmp.name) / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "ddpdoctor", "run", "--out", str(run_dir), "--on-hang", "kill", "--"]
    cmd += [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(JOBS / script), *args]
    proc = subprocess.run(cmd, cwd=tmp.name, capture_output=True, text=True, env=env, timeout=900)
    return proc.returncode, run_dir, proc.stderr, tmp


def stall_to_verdict(run_dir: Path) -> tuple[float, str]:
    summary = json.loads((run_dir / "hang-1" / "summary.json").read_text())
    onsets = [
        s["heartbeat_wall"] - s["phase"]["since_s"] for s in summary["statuses"].values() if s.get("phase")
    ]
    return summary["detected_wall"] - max(onsets), (summary.get("verdict") or {}).get("state", "?")


def latency(trials: int, busy_s: float, only: str | None) -> None:
    rows: list[str] = []
    for name, (script, args, expected) in HUNG.items():
        if only and only not in name:
            continue
        got = []
        for _ in range(trials):
            code, run_dir, err, tmp = run_job(script, args)
            with tmp:
                if not (run_dir / "hang-1" / "summary.json").exists():
                    print(f"{name}: NO VERDICT (exit {code})\n{err[-2000:]}")
                    continue
                lat, state = stall_to_verdict(run_dir)
            got.append(lat)
            print(f"{name}: {state} after {lat:.2f} s (expected {expected})", flush=True)
        if got:
            med, worst = statistics.median(got), max(got)
            rows.append(f"| {name} | {expected} | {len(got)} | {med:.2f} s | {worst:.2f} s | - |")
    for name, (script, args) in SLOW.items():
        if only and only not in name:
            continue
        alarms = 0
        for _ in range(trials):
            code, run_dir, err, tmp = run_job(script, [*args, "--busy-s", str(busy_s)])
            with tmp:
                hung = (run_dir / "hang-1").exists() or "HANG" in err
            alarms += int(hung or code != 0)
            print(f"{name} ({busy_s:g} s): exit {code}, {'FALSE ALARM' if hung else 'no hang'}", flush=True)
        rows.append(f"| {name}, {busy_s:g} s | busy | {trials} | - | - | {alarms} |")
    print("\n| job | verdict | trials | stall -> verdict (median) | max | false alarms |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


def watch_cost(ranks: int, looks: int) -> None:
    from ddpdoctor.supervisor.watch import Watcher

    def phase(name: str | None, op: str = "", seq: int = 40) -> dict | None:
        if name is None:
            return None
        return {"name": name, "op": op, "seq": seq, "since_s": 5.0, "group": "WORLD", "bytes": 32}

    scenarios = {
        "training (no rank waits)": lambda r: phase(None),
        "all in one barrier (blocked)": lambda r: phase("collective", "barrier"),
        "rank 0 busy, the rest in a barrier": lambda r: (
            phase(None) if r == 0 else phase("collective", "barrier")
        ),
        "all in DDP backward (CPU read per rank)": lambda r: phase("backward", "allreduce"),
    }
    print(f"{ranks} simulated ranks, one look = Watcher.poll_once (no stack dumps)")
    for name, make in scenarios.items():
        with tempfile.TemporaryDirectory() as tmp:
            w = Watcher(Path(tmp), report=lambda t: None, use_pyspy=False, since_wall=0)
            times = []
            for i in range(looks):
                now = time.time()
                for r in range(ranks):
                    status = {"rank": r, "world_size": ranks, "pid": os.getpid(), "heartbeat_wall": now}
                    status |= {"events": 100 + (i if name.startswith("training") else 0), "step": 5}
                    status |= {"phase": make(r), "seq": 40, "max_step_s": 1.0}
                    (Path(tmp) / f"status-rank{r}.json").write_text(json.dumps(status))
                t0, c0 = time.perf_counter(), time.thread_time()
                w.poll_once(now + 0.25 * i, detect=False)
                times.append((time.perf_counter() - t0, time.thread_time() - c0))
            wall = statistics.median(t for t, _ in times[1:])
            cpu = statistics.median(c for _, c in times[1:])
            print(
                f"  {name:<42} {wall * 1e3:6.1f} ms wall, {cpu * 1e3:6.1f} ms CPU per look; "
                f"looks every {max(0.25, 5 * cpu):.2f} s"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", nargs="?", default="latency", choices=["latency", "watch-cost"])
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--busy-s", type=float, default=40.0, help="rank-0-only work in the slow jobs")
    parser.add_argument("--only", default=None, help="run only the jobs whose name contains this")
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--looks", type=int, default=6)
    args = parser.parse_args()
    if args.what == "watch-cost":
        watch_cost(args.ranks, args.looks)
    else:
        latency(args.trials, args.busy_s, args.only)


if __name__ == "__main__":
    main()
