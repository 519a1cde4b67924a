"""Can `ddpdoctor diagnose` and `ddpdoctor report` handle 1,024 ranks x 10,000 steps?

    python benchmarks/scale.py --ranks 1024 --steps 10000 --repeat 3

Writes a synthetic multi-node run in the real trace format (hosts of 8 ranks, one straggler,
skewed host clocks; per step and rank: data wait, forward, 4 bucket all-reduces, backward,
optimizer, and a barrier every 100 steps), then runs ``ddpdoctor diagnose DIRS --json`` and
``ddpdoctor report DIRS`` as subprocesses, the way users run them, and measures wall time and
peak memory. Peak memory is the largest sum of the resident sets of the command's whole process
tree (it reads rank files in worker processes), sampled every 20 ms, next to the parent's own
``ru_maxrss``. Target: ``diagnose`` within 10 s, ``report`` within 15 s, at 1 GB peak.
Generation (``trace.synthetic``, the generator the tests use too, one process per host) is not
timed against the target; a run reused from ``--out`` is read once first, so that every timed
command reads the traces from the page cache, as it does after generation. ``--json`` prints
one line: ``diagnose_s`` and ``report_s`` (median of the repeats), ``peak_mb`` (the larger
command's peak) and the details. ``--stages`` adds what the commands are made of, from one
fresh process: reading, analysis and rendering, each timed, with the process's peak resident
set after each (``stages``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ddpdoctor.trace.synthetic import SyntheticJob, write_run


def generate(ranks: int, steps: int, out: Path, workers: int) -> list[str]:
    """Hosts of 8 ranks, one straggler (rank ranks // 3), hosts 1 and 2 with skewed clocks."""
    job = SyntheticJob(
        ranks=ranks,
        steps=steps,
        straggler=ranks // 3,
        host_skew_us={1: 40_000, 2: -250_000},
        command=["torchrun", "train.py"],
    )
    return [str(d) for d in write_run(job, out, processes=workers)]


def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 once it is gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total


def timed(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run ``cmd``; wall seconds, peak tree RSS (sampled) and the parent's own maxrss, in MB."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = [0]
    done = threading.Event()

    def sample() -> None:  # never polls the child: only wait4 below reaps it
        while not done.wait(0.02):
            peak[0] = max(peak[0], _tree_rss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    proc.returncode = os.waitstatus_to_exitcode(status)
    sampler.join()
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode not in (0, 1):  # diagnose exits 1 when it finds an error
        raise SystemExit(f"{cmd} failed ({proc.returncode}): {err[-2000:]}")
    return {"wall_s": wall, "tree_peak_MB": peak[0] / 1e6, "main_maxrss_MB": usage.ru_maxrss / 1e3}


def stages(dirs: list[str]) -> dict[str, float]:
    """Read, analyse and render in this process, each timed, with the peak resident set after
    each: where a command's time and memory go."""
    import resource

    from ddpdoctor import reports
    from ddpdoctor.analysis import diagnose
    from ddpdoctor.trace.reader import load_run

    out: dict[str, float] = {}

    def mark(name: str, t0: float) -> None:
        out[f"{name}_s"] = round(time.perf_counter() - t0, 2)
        out[f"{name}_maxrss_MB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    t = time.perf_counter()
    run = load_run(dirs)
    mark("read", t)
    t = time.perf_counter()
    diag = diagnose(run)
    mark("analyse", t)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        reports.write(diag, Path(tmp) / "report.html", "html")
        mark("render", t)
    return out


def _warm(dirs: list[str]) -> None:
    """Read every file of a reused run once: its first timed command would otherwise measure
    the disk (a cold 2.8 GB read took 4-7 s more here), and the second the code."""
    for d in dirs:
        for p in Path(d).iterdir():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass


def _run_dirs(runs: Path) -> list[str]:
    return sorted((str(d) for d in runs.iterdir() if d.is_dir()), key=lambda s: int(s.rsplit("host", 1)[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3, help="0: only generate")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=None, help="use (or keep) the run dirs here")
    ap.add_argument("--keep", action="store_true", help="do not delete the generated run")
    ap.add_argument("--json", action="store_true", help="print only the one-line JSON result")
    ap.add_argument("--stages", action="store_true", help="also time read, analysis, render in one process")
    ap.add_argument("--stages-of", default=None, help=argparse.SUPPRESS)  # the fresh process itself
    args = ap.parse_args()
    if args.stages_of:
        print(json.dumps(stages(_run_dirs(Path(args.stages_of)))))
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="ddpdoctor-scale-"))
    runs = out / "runs"
    try:
        t = time.perf_counter()
        if runs.is_dir() and any(runs.iterdir()):
            dirs = _run_dirs(runs)
            gen_s = 0.0
            _warm(dirs)  # timed from the page cache, as a run just written is, not from the disk
        else:
            dirs = generate(args.ranks, args.steps, runs, args.workers)
            gen_s = time.perf_counter() - t
        size = sum(p.stat().st_size for d in dirs for p in Path(d).iterdir())
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
        cmds = {
            "diagnose": [sys.executable, "-m", "ddpdoctor", "diagnose", *dirs, "--json"],
            "report": [sys.executable, "-m", "ddpdoctor", "report", *dirs, "-o", str(out / "report.html")],
        }
        result: dict[str, object] = {
            "ranks": args.ranks,
            "steps": args.steps,
            "trace_GB": round(size / 1e9, 2),
            "generate_s": round(gen_s, 1),
        }
        for name, cmd in cmds.items() if args.repeat else ():
            runs_ = [timed(cmd, env) for _ in range(args.repeat)]
            walls = [r["wall_s"] for r in runs_]
            result[name] = {
                "wall_s_best": round(min(walls), 1),
                "wall_s_median": round(statistics.median(walls), 1),
                "tree_peak_MB_max": round(max(r["tree_peak_MB"] for r in runs_)),
                "main_maxrss_MB_max": round(max(r["main_maxrss_MB"] for r in runs_)),
            }
            result[f"{name}_s"] = round(statistics.median(walls), 2)
            if not args.json:
                print(name, json.dumps(result[name]), file=sys.stderr, flush=True)
        if args.repeat:
            result["report_MB"] = round(os.path.getsize(out / "report.html") / 1e6, 2)
            result["peak_mb"] = max(result[n]["tree_peak_MB_max"] for n in cmds)  # type: ignore[index]
        result["trace_bytes_per_rank_step"] = round(size / (args.ranks * args.steps), 1)
        if args.stages:
            cmd = [sys.executable, __file__, "--stages-of", str(runs)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            result["stages"] = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    finally:
        if not args.keep and not args.out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
