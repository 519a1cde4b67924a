"""What recording costs the training thread in instructions: a figure the host's noise cannot move.

The timed benchmarks (``overhead.py``, ``step_cost.py``) measure a few microseconds against
calls and steps whose own time moves by more than that between rounds on a shared 2-core VM.
Here each case runs under valgrind's callgrind, which counts the instructions every thread
executes: the same code counts the same on any day. Each case runs four times, recorded and
plain, with no calls and with ``--calls``/``--steps`` of them after the same warm-up, and the
figure is the training thread's (recorded minus plain) per call or step. The garbage collector
is switched off in all four, from the start: under valgrind the doctor's threads, which run on
wall-clock periods, run fifty times more per step than in real time and their allocations set
off collections in the training thread that a real run does not have (in real time neither
mode collected once in 20,000 tiny steps on 2026-11-29). Their number varies from run to run,
and once torch._dynamo is imported (DDP's constructor does) one full collection is worth
millions of instructions.

- ``collective``: a 1-element gloo ``all_reduce`` (world size 1), as ``overhead.py``'s
  ``per_event_us``: recorded (``dist.all_reduce``) against torch's own function;
- ``step``: a tiny DDP step (``overhead_job.py``'s tiny model: forward, backward, SGD step)
  under the doctor against the same script without it.

Instructions are not time: cold caches, branch misses and the host decide how fast they run (on
2026-11-29 this VM ran a recorded collective's extra instructions at about one per
nanosecond). The figure says how much work the doctor adds and, with ``--top``, where
(functions by instructions added, per call or step; negative: work the doctor saves, as the
C++ bucket timer's reduction does against DDP's own).

    python benchmarks/instructions.py [--case collective step] [--calls 5000] [--steps 1000]
                                      [--warmup 3000] [--top 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

CHILD = """
import gc, os, sys, tempfile
gc.disable()
os.environ["MASTER_ADDR"] = "127.0.0.1"
os.environ["MASTER_PORT"] = str(29000 + os.getpid() % 1000)
os.environ["DDPDOCTOR_RUN_DIR"] = tempfile.mkdtemp()
case, mode, warmup, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "recorded" or case == "collective":
    import ddpdoctor.probes as probes
    probes.install()
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
if case == "collective":
    from ddpdoctor.probes.patching import original
    t = torch.ones(1)
    f = dist.all_reduce if mode == "recorded" else original(dist.all_reduce)
    def one():
        f(t)
else:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, __BENCHMARKS__)  # overhead_job.py: the tiny model
    from overhead_job import build
    torch.manual_seed(0)
    module, width, batch = build("tiny")
    model = DDP(module, bucket_cap_mb=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    loss_fn = nn.CrossEntropyLoss()
    def one():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
for _ in range(warmup):
    one()
for _ in range(n):
    one()
os._exit(0)  # the same exit in every run: no teardown counted
"""

_LINE = re.compile(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)")


def _callgrind(child: Path, out: Path, case: str, mode: str, warmup: int, n: int) -> Path:
    """Run one case under callgrind; the training thread's profile (callgrind's thread 1)."""
    prefix = out / f"{case}.{mode}.{n}"
    cmd = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes",
        f"--callgrind-out-file={prefix}", sys.executable, str(child), case, mode, str(warmup), str(n),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same start-up in every run: a count that repeats
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    main = Path(f"{prefix}-01")
    if done.returncode != 0 or not main.is_file():
        raise SystemExit(f"callgrind failed on {case}/{mode}/{n}:\n{done.stderr[-2000:]}")
    return main


def _functions(profile: Path) -> tuple[int, dict[str, int]]:
    """The profile's total and each function's own instructions (callgrind_annotate's table)."""
    text = subprocess.run(
        ["callgrind_annotate", "--auto=no", "--threshold=100", str(profile)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    total, own = 0, {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        count, name = int(m.group(1).replace(",", "")), m.group(2).strip()
        if "PROGRAM TOTALS" in name:
            total = count
            continue
        name = re.sub(r"\s*\[[^\]]*\]$", "", name)  # the library's path
        name = re.sub(r"^/tmp/python-build[^:]*/", "", name)  # CPython's build directory
        own[name] = own.get(name, 0) + count
    return total, own


def measure(case: str, n: int, warmup: int, top: int, workdir: Path, child: Path) -> dict[str, Any]:
    runs = [(mode, k) for mode in ("recorded", "plain") for k in (0, n)]
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        counted = pool.map(lambda r: _callgrind(child, workdir, case, r[0], warmup, r[1]), runs)
        paths = dict(zip(runs, counted))
    profiles = {r: _functions(p) for r, p in paths.items()}

    def per(mode: str) -> tuple[float, dict[str, float]]:
        (t0, f0), (t1, f1) = profiles[mode, 0], profiles[mode, n]
        return (t1 - t0) / n, {k: (f1.get(k, 0) - f0.get(k, 0)) / n for k in set(f0) | set(f1)}

    (rec, rec_f), (plain, plain_f) = per("recorded"), per("plain")
    added = {k: rec_f.get(k, 0.0) - plain_f.get(k, 0.0) for k in set(rec_f) | set(plain_f)}
    ranked = sorted(added.items(), key=lambda kv: -abs(kv[1]))[:top]
    return {
        "case": case,
        "count": n,
        "plain_instructions": round(plain),
        "recorded_instructions": round(rec),
        "added_instructions": round(rec - plain),
        "added_ratio": round(rec / plain, 4) if plain else None,
        "top": [{"function": k, "added": round(v)} for k, v in ranked],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="+", choices=("collective", "step"), default=["collective", "step"])
    ap.add_argument("--calls", type=int, default=5000, help="collectives counted (collective case)")
    ap.add_argument("--steps", type=int, default=1000, help="training steps counted (step case)")
    ap.add_argument("--warmup", type=int, default=3000, help="calls or steps before counting")
    ap.add_argument("--top", type=int, default=15, help="functions listed by instructions added")
    ap.add_argument("--json", action="store_true", help="print only the one-line JSON result")
    args = ap.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        print("instructions.py needs valgrind (callgrind and callgrind_annotate)", file=sys.stderr)
        raise SystemExit(2)
    if min(args.calls, args.steps) < 1 or args.warmup < 0:
        ap.error("--calls and --steps must be at least 1, --warmup at least 0")
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="instructions_") as tmp:
        child = Path(tmp) / "counted.py"  # a file, as a training script is (see overhead.py)
        child.write_text(CHILD.replace("__BENCHMARKS__", repr(str(Path(__file__).resolve().parent))))
        for case in args.case:
            n = args.calls if case == "collective" else args.steps
            result[case] = measure(case, n, args.warmup, args.top, Path(tmp), child)
    if args.json:
        print(json.dumps(result))
        return
    for case, r in result.items():
        unit = "call" if case == "collective" else "step"
        print(
            f"{case}: {r['added_instructions']:+,} instructions per {unit} on the training thread "
            f"({r['plain_instructions']:,} plain, {r['recorded_instructions']:,} recorded: "
            f"{r['added_ratio']}x)"
        )
        for row in r["top"]:
            print(f"  {row['added']:+9,}  {row['function'][:110]}")


if __name__ == "__main__":
    main()
