"""CPU cost of `ddpdoctor top` at scale: one frame over N synthetic status files (and 8 GPUs).

Writes N ``status-rank{R}.json`` files shaped like the ranks' own (16 recent steps of bucket
waits, a sync point on some ranks, 4 fingerprint checks), a growing ``gpu-<host>.jsonl`` and
run.json, then times ``Top.snapshot`` + ``render`` (what one refresh does) in CPU seconds of
this process. At one refresh a second, CPU seconds per frame is the share of one core. The
status files are rewritten between frames (as the ranks do), so the page cache is warm but the
JSON is new.

    PYTHONPATH=. python benchmarks/top_cost.py --ranks 1024 --frames 20
    PYTHONPATH=. python benchmarks/top_cost.py --ranks 1024 --loop 30   # a real `top` process

``--loop S`` runs `ddpdoctor top` itself for S seconds over files rewritten every second and
reads its CPU time from /proc: the refresh loop's own budget included.
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

from ddpdoctor.live.top import Top, render


def status(rank: int, step: int, now: float) -> dict:
    phase = {"name": "backward", "op": "allreduce", "seq": 4 * step, "since_s": 0.012} if rank % 3 else None
    return {
        "schema": "ddpdoctor.status/1",
        "rank": rank,
        "world_size": 1024,
        "local_rank": rank % 8,
        "host": f"node{rank // 8}",
        "pid": 100000 + rank,
        "heartbeat_wall": now,
        "progress_wall": now,
        "exited": False,
        "step": step,
        "events": 40 * step,
        "seq": 4 * step,
        "phase": phase,
        "max_step_s": 0.31,
        "faulthandler": f"/shared/run/stacks-rank{rank}.txt",
        "ptracer": True,
        "error": None,
        "steps_per_s": 3.2,
        "last_step_wall": now - 0.1,
        "sync_wait_us": [[s, 20000 + (rank * 7919 + s * 104729) % 9000] for s in range(step - 16, step)],
        "last_collective": {"op": "allreduce", "seq": 4 * step - 1, "ago_s": 0.05},
        "fingerprints": [
            {"model": 0, "step": s, "at": "step", "params": 2**52 + s, "buffers": 2**51 + s + rank}
            for s in (step - 193, step - 129, step - 65, step - 1)
        ],
    }


def write_all(run_dir: Path, ranks: int, step: int) -> None:
    now = time.time()
    for r in range(ranks):
        tmp = run_dir / f".status-rank{r}.json.tmp"
        tmp.write_text(json.dumps(status(r, step, now), separators=(",", ":")))
        os.replace(tmp, run_dir / f"status-rank{r}.json")
    with open(run_dir / "gpu-node0.jsonl", "a") as fh:
        for g in range(8):
            fh.write(json.dumps(["gpu", step, 0, -1, {"gpu": g, "util": 80 + g, "mem_used": 1 << 30}]) + "\n")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop(ranks: int, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        (run_dir / "run.json").write_text(json.dumps({"status": "running"}))
        write_all(run_dir, ranks, 100)
        stop = threading.Event()

        def rewrite() -> None:
            step = 101
            while not stop.wait(1.0):
                write_all(run_dir, ranks, step)
                step += 1

        writer = threading.Thread(target=rewrite, daemon=True)
        writer.start()
        command = [sys.executable, "-m", "ddpdoctor", "top", str(run_dir)]
        top = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            time.sleep(5)  # past the interpreter's start-up
            c0, t0 = _cpu_s(top.pid), time.monotonic()
            time.sleep(seconds)
            c1, t1 = _cpu_s(top.pid), time.monotonic()
        finally:
            top.kill()
            stop.set()
            writer.join()
        share = 100 * (c1 - c0) / (t1 - t0)
        print(
            f"`ddpdoctor top` over {ranks} ranks: {share:.1f} % of one core over {t1 - t0:.0f} s "
            f"(load average {os.getloadavg()[0]:.1f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--frames", type=int, default=20)
    parser.add_argument("--loop", type=float, default=0.0, metavar="SECONDS")
    args = parser.parse_args()
    if args.loop:
        loop(args.ranks, args.loop)
        return
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        (run_dir / "run.json").write_text(json.dumps({"status": "running"}))
        top = Top([run_dir])
        cpu: list[float] = []
        for frame in range(args.frames):
            write_all(run_dir, args.ranks, 100 + frame)
            t0 = time.process_time()
            text = render(top.snapshot())
            cpu.append(time.process_time() - t0)
        med, low, high = statistics.median(cpu) * 1000, min(cpu) * 1000, max(cpu) * 1000
        print(
            f"{args.ranks} ranks, {args.frames} frames: CPU ms per frame median {med:.1f}, min {low:.1f}, "
            f"max {high:.1f} -> {med / 10:.1f} % of one core at 1 refresh/s (min {low / 10:.1f} %); "
            f"{len(text.splitlines())} lines per frame; load average {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
