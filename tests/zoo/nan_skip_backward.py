"""Rank 1 skips the backward of a step whose loss it judges bad (a NaN guard decided on one
rank): gloo matches all-reduces by order, so from that step on rank 0's gradient all-reduce of
step k pairs with rank 1's of step k+1, and only the barrier at the end stops the job. The root
is the step where the ranks' sequences first parted, not the barrier."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": "skipped_gradient_sync", "rank": 1, "fix": "every rank", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(12):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))  # zoo: place
        if rank == 1 and step == 5:  # stands in for `if not torch.isfinite(loss):`
            continue
        loss.backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
