"""Rank 1 calls sys.exit(0) mid-epoch (a 'good enough' check evaluated on its own loss); rank 0
is left in a collective nobody joins."""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "rank_left_early", "rank": 1, "fix": "every rank", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)  # zoo: place
        loss.backward()
        opt.step()
        if rank == 1 and step == 4:
            sys.exit(0)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
