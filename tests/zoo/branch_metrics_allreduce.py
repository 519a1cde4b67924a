"""Rank 0 averages its validation loss with an all_reduce inside `if rank == 0:` at the end of
each epoch; rank 1 never joins it."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "rank_only_collective", "rank": 0, "fix": "branch", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        if rank == 0:
            val = loss.detach().clone()
            dist.all_reduce(val)  # zoo: place
            print(f"epoch {epoch}: {val.item() / 2:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
