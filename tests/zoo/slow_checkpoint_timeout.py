"""Rank 0 writes a checkpoint that takes longer than the process group's timeout while rank 1
waits in the barrier after it: rank 1's gloo timeout is a consequence of the save."""

import datetime
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

# The save is the awaited work: the waiting rank's timeout is its consequence.
EXPECT = {"kind": "awaited_work", "rank": 0, "fix": "timeout", "options": []}


def save_checkpoint(model: nn.Module) -> None:
    state = model.state_dict()
    for _ in range(200):
        time.sleep(0.05)  # zoo: place
    torch.save(state, "ckpt.pt")


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=4))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
    if rank == 0:
        save_checkpoint(model.module)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
