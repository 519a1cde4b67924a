"""Healthy twin of branch_barrier_hang: rank 0 saves model.module's state each epoch; every
rank meets at the barrier outside the branch."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    path = os.path.join(tempfile.gettempdir(), f"zoo-ckpt-{os.getpid()}.pt")
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if rank == 0:
            torch.save(model.module.state_dict(), path)
        dist.barrier()
    if rank == 0:
        os.remove(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
