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

``--cache`` also simulates the caches (callgrind's ``--cache-sim``: this machine's L1 sizes, 32
KiB each for code and data) and adds the first-level misses the recording adds per call or
step. After a call that blocks (gloo hands the work to its own thread and waits), the training
thread comes back to caches that other code has used, and what the doctor's code then costs
follows from how many cache lines it touches more than from how many instructions it runs.

    python benchmarks/instructions.py [--case collective step] [--calls 5000] [--steps 1000]
                                      [--warmup 3000] [--top 15] [--cache] [--json]
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

EVENTS = ("Ir", "I1mr", "D1mr", "D1mw")  # instructions; first-level code, data-read, data-write misses
_COUNT = re.compile(r"([\d,]+|\.)(?:\s+\(\s*[\d.]+%\))?\s+")


def _callgrind(child: Path, out: Path, case: str, mode: str, warmup: int, n: int, cache: bool) -> Path:
    """Run one case under callgrind; the training thread's profile (callgrind's thread 1)."""
    prefix = out / f"{case}.{mode}.{n}"
    cmd = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes", f"--cache-sim={'yes' if cache else 'no'}",
        f"--callgrind-out-file={prefix}", sys.executable, str(child), case, mode, str(warmup), str(n),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same start-up in every run: a count that repeats
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    main = Path(f"{prefix}-01")
    if done.returncode != 0 or not main.is_file():
        raise SystemExit(f"callgrind failed on {case}/{mode}/{n}:\n{done.stderr[-2000:]}")
    return main


def _functions(profile: Path, cache: bool) -> tuple[list[int], dict[str, list[int]]]:
    """The profile's totals and each function's own counts (callgrind_annotate's table), one per
    event counted: instructions, and with ``cache`` the misses of ``EVENTS``."""
    events = EVENTS if cache else EVENTS[:1]
    text = subprocess.run(
        ["callgrind_annotate", "--auto=no", "--threshold=100", f"--show={','.join(events)}", str(profile)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    total, own = [0] * len(events), {}
    for line in text.splitlines():
        line, counts, at = line.strip(), [], 0
        while len(counts) < len(events) and (m := _COUNT.match(line, at)):
            counts.append(0 if m.group(1) == "." else int(m.group(1).replace(",", "")))
            at = m.end()
        name = line[at:].strip()
        if len(counts) < len(events) or not name:
            continue
        if "PROGRAM TOTALS" in name:
            total = counts
            continue
        name = re.sub(r"\s*\[[^\]]*\]$", "", name)  # the library's path
        name = re.sub(r"^/tmp/python-build[^:]*/", "", name)  # CPython's build directory
        own[name] = [a + b for a, b in zip(own.get(name, [0] * len(events)), counts)]
    return total, own


def measure(
    case: str, n: int, warmup: int, top: int, workdir: Path, child: Path, cache: bool
) -> dict[str, Any]:
    runs = [(mode, k) for mode in ("recorded", "plain") for k in (0, n)]
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        counted = pool.map(lambda r: _callgrind(child, workdir, case, r[0], warmup, r[1], cache), runs)
        paths = dict(zip(runs, counted))
    profiles = {r: _functions(p, cache) for r, p in paths.items()}
    width = len(EVENTS) if cache else 1

    def per(mode: str) -> tuple[list[float], dict[str, list[float]]]:
        (t0, f0), (t1, f1) = profiles[mode, 0], profiles[mode, n]
        zero = [0] * width
        return [(b - a) / n for a, b in zip(t0, t1)], {
            k: [(b - a) / n for a, b in zip(f0.get(k, zero), f1.get(k, zero))] for k in set(f0) | set(f1)
        }

    (rec, rec_f), (plain, plain_f) = per("recorded"), per("plain")
    zero = [0.0] * width
    added = {k: [a - b for a, b in zip(rec_f.get(k, zero), plain_f.get(k, zero))] for k in {*rec_f, *plain_f}}
    ranked = sorted(added.items(), key=lambda kv: -abs(kv[1][0]))[:top]
    result: dict[str, Any] = {
        "case": case,
        "count": n,
        "plain_instructions": round(plain[0]),
        "recorded_instructions": round(rec[0]),
        "added_instructions": round(rec[0] - plain[0]),
        "added_ratio": round(rec[0] / plain[0], 4) if plain[0] else None,
        "top": [{"function": k, "added": round(v[0])} for k, v in ranked],
    }
    if cache:
        names = {"I1mr": "code_misses", "D1mr": "data_read_misses", "D1mw": "data_write_misses"}
        for i, event in enumerate(EVENTS[1:], 1):
            result[f"plain_{names[event]}"] = round(plain[i])
            result[f"added_{names[event]}"] = round(rec[i] - plain[i])
        for row, (_, v) in zip(result["top"], ranked):
            row["added_code_misses"] = round(v[1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="+", choices=("collective", "step"), default=["collective", "step"])
    ap.add_argument("--calls", type=int, default=5000, help="collectives counted (collective case)")
    ap.add_argument("--steps", type=int, default=1000, help="training steps counted (step case)")
    ap.add_argument("--warmup", type=int, default=3000, help="calls or steps before counting")
    ap.add_argument("--top", type=int, default=15, help="functions listed by instructions added")
    ap.add_argument("--cache", action="store_true", help="also count the first-level cache misses added")
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
            result[case] = measure(case, n, args.warmup, args.top, Path(tmp), child, args.cache)
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
        if "added_code_misses" in r:
            print(
                f"  first-level cache misses added per {unit}: {r['added_code_misses']:+,} code "
                f"({r['plain_code_misses']:,} plain), {r['added_data_read_misses']:+,} data read "
                f"({r['plain_data_read_misses']:,}), {r['added_data_write_misses']:+,} data write "
                f"({r['plain_data_write_misses']:,})"
            )
        for row in r["top"]:
            misses = f"  ({row['added_code_misses']:+,} code misses)" if "added_code_misses" in row else ""
            print(f"  {row['added']:+9,}  {row['function'][:100]}{misses}")


if __name__ == "__main__":
    main()
