"""Gradient accumulation whose schedule depends on the rank (rank 0 syncs every 2 micro-steps,
rank 1 every 4, from a per-rank memory estimate): gloo pairs rank 0's all-reduce of micro-step 1
with rank 1's of micro-step 3, and the job goes on averaging gradients of different steps until
the ranks' counts of all-reduces differ at the end."""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": "skipped_gradient_sync", "rank": 1, "fix": "schedule", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    accumulate = 2 if rank == 0 else 4
    for step in range(12):
        sync = (step + 1) % accumulate == 0
        with contextlib.nullcontext() if sync else model.no_sync():
            loss = nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))  # zoo: place
            loss.backward()
        if sync:
            opt.step()
            opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
