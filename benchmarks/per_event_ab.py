"""The training thread's cost per recorded collective, before and after a change: two checkouts
of ddpdoctor measured alternately, each measurement in a fresh process.

Each measurement installs that checkout's probes in a 1-rank gloo process group and takes the
difference between a recorded and the original 1-element ``all_reduce`` as ``overhead.py``'s
``PAIRED_BLOCKS`` does, in wall time and in the thread's CPU time (which other processes on a
shared machine disturb far less). Alternating the checkouts, first one then the other leading,
spreads the machine's drift over both.

    python benchmarks/per_event_ab.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import PAIRED_BLOCKS, run_as_script  # noqa: E402

MEASURE = """
import json, os, statistics, tempfile, time
os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = str(29000 + os.getpid() % 1000)
os.environ["DDPDOCTOR_RUN_DIR"] = tempfile.mkdtemp()
import ddpdoctor.probes as probes; probes.install()
import torch, torch.distributed as dist
from ddpdoctor.probes.patching import original
dist.init_process_group("gloo", rank=0, world_size=1)
t, n = torch.ones(1), 5000
def bench(f, clock=time.perf_counter):
    t0 = clock()
    for _ in range(n):
        f(t)
    return (clock() - t0) / n * 1e6
rec, plain = dist.all_reduce, original(dist.all_reduce)
wall = paired_blocks(rec, plain, t, time.perf_counter)
cpu = paired_blocks(rec, plain, t, time.thread_time)
result = {"wall_us": wall["median"], "cpu_us": cpu["median"], "plain_us": bench(plain)}
print(json.dumps(result))
"""


def measure(checkout: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    out = run_as_script(PAIRED_BLOCKS + MEASURE, env)
    if out.returncode != 0:
        raise SystemExit(f"{checkout}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", action="store_true", help="print only the one-line JSON result")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            runs[name].append(measure(getattr(args, name)))
            if not args.json:
                print(name, json.dumps(runs[name][-1]), flush=True)
    result = {
        f"{name}_{key}": round(statistics.median(m[key] for m in ms), 3)
        for name, ms in runs.items()
        for key in ("cpu_us", "wall_us", "plain_us")
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
