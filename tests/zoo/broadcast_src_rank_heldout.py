"""Every rank is meant to start from the same augmentation seed, but the broadcast passes
src=rank: each rank believes it is the root, the ranks disagree on the broadcast's source and the
job never gets past it."""

import random

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": None, "rank": None, "fix": "src", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def shared_seed(rank: int) -> int:
    seed = torch.tensor([random.randrange(2**31)], dtype=torch.int64)
    dist.broadcast(seed, src=rank)  # zoo: place
    return int(seed.item())


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
    aug = torch.Generator().manual_seed(shared_seed(rank))
    for x, y in loader:
        x = x + 0.01 * torch.randn(x.shape, generator=aug)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
