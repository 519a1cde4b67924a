"""Healthy twin of broadcast_src_rank: each epoch rank 0 draws the augmentation seed and every
rank receives it with dist.broadcast(seed, src=0). Nothing is wrong."""

import random

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    random.seed(1234 + rank)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 10), torch.randint(0, 3, (128,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        seed = torch.tensor([random.randrange(2**31) if rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(seed, src=0)
        aug = torch.Generator().manual_seed(int(seed.item()))
        for x, y in loader:
            x = x + 0.01 * torch.randn(x.shape, generator=aug)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
