"""Healthy twin: every rank runs the full schedule (2 epochs, DistributedSampler with
set_epoch), reaches a final barrier, tears the process group down, logs a summary on rank 0,
and then every rank calls sys.exit(0) explicitly -- the habit of scripts that also run as CLI
tools. Exit status 0 everywhere, at the same point of the program: nothing is wrong."""

import sys

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
    data = TensorDataset(torch.randn(160, 16), torch.randint(0, 4, (160,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    last = torch.zeros(())
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            last = loss.detach()
    dist.all_reduce(last)
    dist.barrier()
    if rank == 0:
        print(f"done, mean final loss {last.item() / dist.get_world_size():.3f}", flush=True)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
