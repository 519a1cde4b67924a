"""Can `ddpdoctor diagnose` and `ddpdoctor report` handle 1,024 ranks x 10,000 steps?

    python benchmarks/scale.py --ranks 1024 --steps 10000 --repeat 3

Writes a synthetic multi-node run in the real trace format (hosts of 8 ranks, one straggler,
skewed host clocks; per step and rank: data wait, forward, 4 bucket all-reduces, backward,
optimizer, and a barrier every 100 steps), then runs ``ddpdoctor diagnose DIRS --json`` and
``ddpdoctor report DIRS`` as subprocesses, the way users run them, and measures wall time and
peak memory. Peak memory is the largest sum of the resident sets of the command's whole process
tree (it reads rank files in worker processes), sampled every 20 ms, next to the parent's own
``ru_maxrss``. Target: each command within 60 s and 2 GB. Generation is not timed against the
target; it is numpy plus one big ``%`` format per rank, one process per host.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ddpdoctor.trace import schema

RANKS_PER_HOST = 8
BUCKETS = 4
BARRIER_EVERY = 100
BUCKET_BYTES = [4_000_000 * (i + 1) for i in range(BUCKETS)]

# Per-step model, filled in the parent before forking the writers: (steps, ranks) arrays of
# true µs since job start.
_MODEL: dict[str, np.ndarray] = {}


def model(ranks: int, steps: int, straggler: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The same step model as ``trace.synthetic``: all-reduces end after the slowest rank."""
    rng = np.random.default_rng(seed)
    n, nb = ranks, BUCKETS
    start = rng.integers(0, 2_000, n)
    shape = (steps, n)
    data = rng.integers(200, 1_500, shape)
    data[:, straggler] += 30_000 + rng.integers(0, 5_000, steps)
    fwd = rng.integers(8_000, 10_000, shape)
    bwd = rng.integers(15_000, 20_000, shape)
    opt = rng.integers(1_000, 2_000, shape)
    t_all = np.empty(shape, np.int64)
    ready_all = np.empty((steps, n, nb), np.int64)
    done_all = np.empty((steps, nb), np.int64)
    bwd_end_all = np.empty(shape, np.int64)
    bar_end = np.zeros(steps, np.int64)
    t = 2_000 + start.astype(np.int64)
    frac = (np.arange(nb) + 1)[None, :]
    for k in range(steps):
        t_all[k] = t
        fwd_start = t + data[k]
        bwd_start = fwd_start + fwd[k] + 50
        ready = bwd_start[:, None] + (bwd[k][:, None] * frac) // (nb + 1)
        done = np.maximum.accumulate(ready.max(axis=0) + 1_500 + np.arange(nb) * 300)
        bwd_end = np.maximum(bwd_start + bwd[k], done[-1] + 20)
        t_next = bwd_end + 30 + opt[k] + 20
        ready_all[k], done_all[k], bwd_end_all[k] = ready, done, bwd_end
        if (k + 1) % BARRIER_EVERY == 0:
            bar_end[k] = int(t_next.max()) + 200
            t = np.full(n, bar_end[k] + 10)
        else:
            t = t_next
    return {
        "start": start,
        "t": t_all,
        "data": data,
        "fwd": fwd,
        "bwd_end": bwd_end_all,
        "ready": ready_all,
        "done": done_all,
        "opt": opt,
        "bar_end": bar_end,
    }


def _templates(n: int) -> tuple[str, str]:
    """One step's lines as a % template, without and with the barrier."""
    lines = [
        '["data_wait",%d,%d,%d,1]',
        '["forward",%d,%d,%d,1,1,%d]',
        *(f'["allreduce",%d,%d,%d,{i},{BUCKET_BYTES[i]},%d]' for i in range(BUCKETS)),
        '["backward",%d,%d,%d]',
        '["optimizer",%d,%d,%d,"AdamW"]',
    ]
    plain = "\n".join(lines) + "\n"
    return plain, plain + f'["collective",%d,%d,%d,"barrier",0,"WORLD",{n},%d,0]\n'


def _write_rank(rank: int, n: int, out_dir: Path) -> None:
    m = _MODEL
    steps = m["t"].shape[0]
    nb = BUCKETS
    base = -int(m["start"][rank])
    k = np.arange(steps, dtype=np.int64)
    barrier = (k + 1) % BARRIER_EVERY == 0
    seq = 1 + k * nb + np.concatenate([[0], np.cumsum(barrier)[:-1]])
    t, data, fwd, opt = (m[x][:, rank] for x in ("t", "data", "fwd", "opt"))
    fwd_start = t + data
    bwd_start = fwd_start + fwd + 50
    bwd_end = m["bwd_end"][:, rank]
    ready = m["ready"][:, rank, :]
    cols = [t + base, data, k - 1, fwd_start + base, fwd, k, seq]
    for i in range(nb):
        cols += [ready[:, i] + base, m["done"][:, i] - ready[:, i], k, seq + i]
    opt_start = bwd_end + 30
    cols += [bwd_start + base, bwd_end - bwd_start, k, opt_start + base, opt, k]
    t_next = opt_start + opt + 20
    cols += [t_next + base, m["bar_end"] - t_next, k, seq + nb]
    values = np.stack(cols, axis=1)
    keep = np.ones(values.shape, bool)
    keep[~barrier, -4:] = False
    plain, with_barrier = _templates(n)
    block = plain * (BARRIER_EVERY - 1) + with_barrier
    template = block * (steps // BARRIER_EVERY) + plain * (steps % BARRIER_EVERY)
    header = {
        "schema": schema.SCHEMA,
        "rank": rank,
        "world_size": n,
        "local_rank": rank % RANKS_PER_HOST,
        "host": f"node{rank // RANKS_PER_HOST}",
        "pid": 1000 + rank,
        "wall_ns": (1_700_000_000_000_000 + int(m["start"][rank]) + _skew(rank)) * 1000,
        "mono_ns": 5_000_000_000 + rank,
        "backend": "nccl",
        "torch": "2.13.0",
        "argv": ["train.py"],
        "restart": 0,
    }
    options = {"find_unused_parameters": False, "broadcast_buffers": True, "bucket_cap_mb": 25.0}
    init = {"module": "Net", "params": sum(BUCKET_BYTES) // 4, "param_bytes": sum(BUCKET_BYTES)}
    init.update({"buckets": BUCKET_BYTES, "seq": 0, "options": options})
    loader = {"id": 1, "sampler": "DistributedSampler", "epoch": 0, "shuffle": True, "batch_size": 32}
    loader.update({"drop_last": False, "num_workers": 4, "dataset_len": 32 * n * steps})
    head = [
        [schema.HEADER, header],
        [schema.DDP_INIT, 0, 1_000, -1, init],
        [schema.CLOCK, 1_000, 0, -1, {"offset_ns": -_skew(rank) * 1000, "rtt_ns": 120_000, "ref_rank": 0}],
        [schema.LOADER, 1_500, 0, -1, loader],
        [schema.COMM_HOOK, 1_600, 0, -1, {"name": "ddp default", "user": False}],
    ]
    head += [
        [schema.BUCKET, 1_700, 0, 0, {"index": i, "bytes": BUCKET_BYTES[i], "params": [f"layers.{i}.weight"]}]
        for i in range(nb)
    ]
    end = int(m["t"][-1, rank] + base + 50_000)
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in head)
    text += template % tuple(values[keep].tolist())
    text += json.dumps([schema.END, end, 0, steps - 1, {"reason": "exit"}]) + "\n"
    (out_dir / schema.trace_filename(rank)).write_text(text, encoding="utf-8")


def _skew(rank: int) -> int:
    host = rank // RANKS_PER_HOST
    return {1: 40_000, 2: -250_000}.get(host, 0)


def _write_host(args: tuple[int, int, str]) -> str:
    host, n, out = args
    out_dir = Path(out) / f"host{host}"
    out_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(host * RANKS_PER_HOST, min(n, (host + 1) * RANKS_PER_HOST)):
        _write_rank(rank, n, out_dir)
    meta = {"schema": "ddpdoctor.run/1", "command": ["torchrun", "train.py"], "exit_code": 0}
    (out_dir / "run.json").write_text(json.dumps(dict(meta, status="finished", host=f"node{host}")))
    return str(out_dir)


def generate(ranks: int, steps: int, out: Path, workers: int) -> list[str]:
    _MODEL.clear()
    _MODEL.update(model(ranks, steps, straggler=ranks // 3))
    hosts = (ranks + RANKS_PER_HOST - 1) // RANKS_PER_HOST
    with mp.get_context("fork").Pool(workers) as pool:
        dirs = pool.map(_write_host, [(h, ranks, str(out)) for h in range(hosts)], chunksize=1)
    _MODEL.clear()
    return dirs


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

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    sampler.join()
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode not in (0, 1):  # diagnose exits 1 when it finds an error
        raise SystemExit(f"{cmd} failed ({proc.returncode}): {err[-2000:]}")
    return {"wall_s": wall, "tree_peak_MB": peak[0] / 1e6, "main_maxrss_MB": usage.ru_maxrss / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3, help="0: only generate")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=None, help="use (or keep) the run dirs here")
    ap.add_argument("--keep", action="store_true", help="do not delete the generated run")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="ddpdoctor-scale-"))
    runs = out / "runs"
    try:
        t = time.perf_counter()
        if runs.is_dir() and any(runs.iterdir()):
            dirs = sorted(
                (str(d) for d in runs.iterdir() if d.is_dir()), key=lambda s: int(s.rsplit("host", 1)[1])
            )
            gen_s = 0.0
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
            print(name, json.dumps(result[name]), file=sys.stderr, flush=True)
        if args.repeat:
            result["report_MB"] = round(os.path.getsize(out / "report.html") / 1e6, 2)
        print(json.dumps(result, indent=1))
    finally:
        if not args.keep and not args.out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
