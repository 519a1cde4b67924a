"""What the model fingerprint (probes/fingerprint.py) costs on this CPU.

1. The hash itself, in ms per million parameters, for one large tensor and for many small ones
   (per-tensor overhead), on one thread (torchrun's default OMP_NUM_THREADS=1).
2. A real training loop (an MLP, SGD) with the fingerprinting driven as in a rank (after every
   optimizer step, auto interval): the share of the loop's time spent in it (every call timed,
   the cheap "not due" ones, the early checks and any preemption included), the steady share
   (one check's cost over the interval's steps: what the 0.1 % budget bounds), the interval the
   budget chose and the checks made.

    PYTHONPATH=. python benchmarks/fingerprint_cost.py [--steps 3000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn as nn

from ddpdoctor.probes import fingerprint as fp


def hash_cost(tensors: int, numel: int, repeat: int = 5) -> dict[str, Any]:
    data = [torch.randn(numel) for _ in range(tensors)]
    fp.hashes(data)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fp.hashes(data)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    return {
        "tensors": tensors,
        "numel": numel,
        "ms": round(ms, 3),
        "ms_per_mparam": round(ms / (tensors * numel / 1e6), 3),
    }


class _Collector:
    def __init__(self) -> None:
        self.step, self.events, self.live, self.disabled, self.records = -1, 0, True, set(), 0

    def put(self, record: tuple) -> None:
        self.records += 1


class _Wrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def training_share(width: int, depth: int, batch: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(batch, width)
    c = _Collector()
    f = fp.Fingerprints(c)
    wrapper = _Wrapper(net)  # held, as DDP holds its module (the fingerprint keeps a weak reference)
    f.add(wrapper, 0, list(net.parameters()))
    spent = 0
    t_start = time.perf_counter_ns()
    for step in range(steps):
        c.step = step
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        t0 = time.perf_counter_ns()
        f.after_step(opt)
        spent += time.perf_counter_ns() - t0
    total = time.perf_counter_ns() - t_start
    params = sum(p.numel() for p in net.parameters())
    return {
        "params": params,
        "step_ms": round(total / steps / 1e6, 3),
        "fingerprint_ms": round(f.cost() / 1e6, 3),
        "interval": f.interval,
        "checks": c.records - 1,  # after steps (the first record is the construction's)
        "share_pct": round(100 * spent / total, 4),  # every call, the first checks and noise included
        # A check every ``interval`` steps once the interval is set: what the budget bounds.
        "steady_share_pct": round(100 * f.cost() / (f.interval * total / steps), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--json", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    result = {
        "hash": [hash_cost(1, 10_000_000), hash_cost(100, 100_000), hash_cost(1000, 1_000)],
        "training": [
            training_share(256, 4, 64, args.steps),  # 0.26 M parameters, ~1 ms steps
            training_share(1024, 4, 64, args.steps // 3),  # 4.2 M parameters
        ],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
