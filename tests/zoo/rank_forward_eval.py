"""Rank 0 evaluates through the DDP wrapper in eval mode under no_grad after each epoch, then
every rank meets at a barrier. It does not hang (no buffers to broadcast), yet rank 0 ran
forwards the other rank did not."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "rank_only_eval", "rank": 0, "fix": "model.module", "options": []}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    val = torch.randn(32, 16)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if rank == 0:
            model.eval()
            with torch.no_grad():
                print("val", model(val).mean().item())  # zoo: place
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
