"""The patient for benchmarks/overhead.py: times its own steps and prints one JSON line.

Usage: overhead_job.py {big|tiny} STEPS [--profiler] [--python-hook]

``--python-hook`` registers torch's own Python ``allreduce_hook``: the reference for what any
comm hook written in Python costs (the doctor times buckets with one).
"""

import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

WARMUP = 5


def build(kind: str) -> tuple[nn.Module, int, int]:
    if kind == "big":  # ~10M parameters, compute-bound on CPU
        return (
            nn.Sequential(
                nn.Linear(1024, 2048),
                nn.ReLU(),
                nn.Linear(2048, 2048),
                nn.ReLU(),
                nn.Linear(2048, 1024),
                nn.ReLU(),
                nn.Linear(1024, 10),
            ),
            1024,
            32,
        )
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)), 32, 8


def main() -> None:
    kind, steps, use_profiler = sys.argv[1], int(sys.argv[2]), "--profiler" in sys.argv
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model, width, batch = build(kind)
    ddp = DDP(model, bucket_cap_mb=4)
    if "--python-hook" in sys.argv:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
    data = TensorDataset(
        torch.randn(batch * (steps + WARMUP) * dist.get_world_size(), width),
        torch.randint(0, 10, (batch * (steps + WARMUP) * dist.get_world_size(),)),
    )
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=True))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    times = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if use_profiler else None
    if prof is not None:
        prof.__enter__()
    it = iter(loader)
    cpu0 = 0.0
    for i in range(steps + WARMUP):
        if i == WARMUP:
            cpu0 = time.process_time()  # this rank's CPU, all its threads: less disturbed by others
        t0 = time.perf_counter()
        x, y = next(it)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    cpu_per_step = (time.process_time() - cpu0) / steps
    if prof is not None:
        prof.__exit__(None, None, None)
    dist.barrier()
    if dist.get_rank() == 0:
        times.sort()
        result = {"median_s": times[len(times) // 2], "cpu_per_step_s": cpu_per_step, "steps": steps}
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
