"""Healthy twin of accumulation_by_rank: every rank accumulates 4 micro-steps under no_sync()
and all-reduces on the fourth, the same schedule everywhere."""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(16):
        sync = (step + 1) % 4 == 0
        with contextlib.nullcontext() if sync else model.no_sync():
            loss = nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
            loss.backward()
        if sync:
            opt.step()
            opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
