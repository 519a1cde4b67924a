"""What the bucket-timing comm hook costs a training step, per bucket, in one process.

DDP reduces gradient buckets in C++; timing each bucket takes a comm hook, and any hook written
in Python costs a trip into the interpreter per bucket and a Python callback when the bucket's
all-reduce completes. This measures that cost where it is paid, in the training loop: one
process (world size 1: gloo on the CPU, NCCL on a GPU when there is one) under the doctor, with
models of 1, 4 and 16 buckets, each built with DDP's own C++ reduction (untimed), with the
Python timing hook, and, where it is built (``ddpdoctor native --build``) and the model is on
the CPU, with the C++ timer (probes/native.py); the timer is chosen per model at its first
forward, and the steps of all models alternate in rounds. The per-bucket cost is the difference
of the medians over the bucket count; ``commhook.HOOK_COST_S`` (the Python hook's) comes from it.

    python benchmarks/hook_cost.py [--rounds 6] [--steps 300] [--cpu] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

BUCKETS = (1, 4, 16)


TIMERS = ("untimed", "python", "cpp")


def build(buckets: int, width: int, device: Any, timer: str) -> Any:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpdoctor.probes import native

    layers = [nn.Linear(width, width, bias=False) for _ in range(buckets)]
    model = nn.Sequential(*layers).to(device)
    cap_mb = width * width * 4 / 2**20  # one layer's gradient per bucket
    ddp = DDP(model, bucket_cap_mb=cap_mb, device_ids=[device.index] if device.type == "cuda" else None)
    os.environ["DDPDOCTOR_BUCKET_TIMING"] = "off" if timer == "untimed" else "on"
    built, native._module = native.module(), native._module
    if timer == "python":
        native._module = None  # this model only: as where the C++ timer is not built
    x = torch.randn(8, width, device=device)
    ddp(x).sum().backward()  # its first forward: the timing hook is registered (or not) here
    native._module = built
    return ddp, x


def steps(ddp: Any, x: Any, n: int, sync: Any) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ddp(x).sum().backward()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--width", type=int, default=0, help="features per layer (default: 128 CPU, 2048 GPU)")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU even where there is a GPU")
    ap.add_argument("--json", action="store_true", help="print only the one-line JSON result")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    import ddpdoctor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    ddpdoctor.instrument(tempfile.mkdtemp(prefix="hook_cost_"))
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
    width = args.width or (2048 if gpu else 128)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    from ddpdoctor.probes import native

    timers = TIMERS if native.module() is not None and not gpu else TIMERS[:2]
    models = {(b, timer): build(b, width, device, timer) for b in BUCKETS for timer in timers}
    medians: dict[tuple[int, str], list[float]] = {key: [] for key in models}
    for _ in range(args.rounds):
        for key, (ddp, x) in models.items():
            steps(ddp, x, 20, sync)
            medians[key].append(steps(ddp, x, args.steps, sync))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "width": width}
    for b in BUCKETS:
        off = statistics.median(medians[(b, "untimed")]) * 1e6
        row: dict[str, float] = {"untimed_us": round(off, 1)}
        for timer in timers[1:]:
            on = statistics.median(medians[(b, timer)]) * 1e6
            row[f"{timer}_us"] = round(on, 1)
            row[f"{timer}_per_bucket_us"] = round((on - off) / b, 1)
        result[f"buckets_{b}"] = row
    dist.destroy_process_group()
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    sys.exit(main())
