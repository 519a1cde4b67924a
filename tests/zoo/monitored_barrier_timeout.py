"""Rank 1 rebuilds a feature cache that takes far longer than the monitored_barrier's timeout
that follows: rank 0 raises "Rank 1 failed to pass monitoredBarrier". The cause is the awaited
work on rank 1, not rank 0's error."""

import datetime
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": "awaited_work", "rank": 1, "fix": "timeout", "options": []}


def rebuild_feature_cache() -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(0.05)  # zoo: place


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
    if rank == 1:
        rebuild_feature_cache()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=3))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
