"""Time from hang onset to the printed diagnosis, on the rank-0 evaluation hang (real torchrun).

For each trial: `ddpdoctor run --hang-timeout T --on-hang kill -- torchrun ... faulty_train.py
--mode eval0`. The onset is when the last rank entered the sync point it is stuck in (from the
ranks' status files kept in hang-1/summary.json: heartbeat - time in phase); the print time is
when the "ddpdoctor: HANG" line reached our end of ddpdoctor's stderr pipe. The requirement is
latency <= T + 3 s.

    PYTHONPATH=. python benchmarks/hang_latency.py --trials 5 --timeout 3 [--no-pyspy] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "jobs" / "faulty_train.py"


def trial(threshold: float, nproc: int, no_pyspy: bool) -> dict[str, float | str]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        if no_pyspy:
            env["PATH"] = "/usr/bin:/bin"
        cmd = [
            sys.executable,
            "-m",
            "ddpdoctor",
            "run",
            "--out",
            str(run_dir),
            "--hang-timeout",
            str(threshold),
        ]
        cmd += ["--on-hang", "kill", "--", sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={nproc}", str(JOB), "--mode", "eval0"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        printed: list[float] = []

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                if line.startswith("ddpdoctor: HANG") and not printed:
                    printed.append(time.time())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        proc.wait(timeout=180)
        reader.join(5)
        summary = json.loads((run_dir / "hang-1" / "summary.json").read_text())
        entries = [
            s["heartbeat_wall"] - s["phase"]["since_s"]
            for s in summary["statuses"].values()
            if s.get("phase")
        ]
        methods = sorted({d.get("method") or "none" for d in summary["stacks"].values()})
        return {
            "latency_s": printed[0] - max(entries),  # from the moment every rank was stuck
            "from_first_wait_s": printed[0] - min(entries),
            "stacks_s": summary["reported_wall"] - summary["detected_wall"],
            "method": ",".join(methods),
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=3.0, help="--hang-timeout of each trial")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--no-pyspy", action="store_true", help="hide py-spy: faulthandler fallback")
    args = parser.parse_args()
    rows = [trial(args.timeout, args.nproc, args.no_pyspy) for _ in range(args.trials)]
    for i, r in enumerate(rows):
        print(
            f"trial {i}: onset->printed {r['latency_s']:.2f} s  first wait->printed "
            f"{r['from_first_wait_s']:.2f} s  stack dump+diagnosis {r['stacks_s']:.2f} s  ({r['method']})"
        )
    lat = [float(r["latency_s"]) for r in rows]
    over = [x - args.timeout for x in lat]
    print(
        f"threshold {args.timeout:g} s, {args.nproc} ranks, {args.trials} trials: onset->printed "
        f"median {statistics.median(lat):.2f} s, max {max(lat):.2f} s "
        f"(max {max(over):.2f} s past the threshold; budget 3 s): {'OK' if max(over) <= 3 else 'TOO SLOW'}"
    )


if __name__ == "__main__":
    main()
