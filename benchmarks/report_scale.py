"""How long the HTML report (and the Chrome trace export) take at scale, and how big they get.

    python benchmarks/report_scale.py --ranks 128 --steps 1000

Writes a synthetic multi-node run in the real trace format (16 hosts of 8 ranks, one
straggler, skewed host clocks), then times each stage the way ``ddpdoctor report`` runs it:
read the run dirs, diagnose, render and write. Target: 128 ranks x 1000 steps in at most
10 s and 10 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from ddpdoctor import reports
from ddpdoctor.analysis import diagnose
from ddpdoctor.trace.reader import load_run
from ddpdoctor.trace.synthetic import SyntheticJob, write_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--out", default=None, help="keep the run dirs and outputs here")
    ap.add_argument("--export", action="store_true", help="also time the Chrome trace export")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="ddpdoctor-bench-"))
    job = SyntheticJob(
        ranks=args.ranks,
        steps=args.steps,
        buckets=args.buckets,
        straggler=args.ranks // 3,
        host_skew_us={1: 40_000, 2: -250_000},
    )
    t = time.perf_counter()
    dirs = write_run(job, out / "runs")
    gen_s = time.perf_counter() - t
    trace_mb = sum(p.stat().st_size for d in dirs for p in d.iterdir()) / 1e6

    t0 = time.perf_counter()
    run = load_run(dirs)
    t1 = time.perf_counter()
    diag = diagnose(run)
    t2 = time.perf_counter()
    report = reports.write(diag, out / "report.html")
    t3 = time.perf_counter()
    result = {
        "ranks": args.ranks,
        "steps": args.steps,
        "events": sum(len(ev) for tr in run.ranks.values() for ev in tr.events.values()),
        "trace_MB": round(trace_mb, 1),
        "generate_s": round(gen_s, 2),
        "read_s": round(t1 - t0, 2),
        "diagnose_s": round(t2 - t1, 2),
        "render_write_s": round(t3 - t2, 2),
        "report_total_s": round(t3 - t0, 2),
        "report_MB": round(os.path.getsize(report) / 1e6, 2),
        "report": str(report),
    }
    if args.export:
        t4 = time.perf_counter()

        trace = reports.write(diag, out / "trace.json")
        result["export_s"] = round(time.perf_counter() - t4, 2)
        result["export_MB"] = round(os.path.getsize(trace) / 1e6, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
