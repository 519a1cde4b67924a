"""Rank 1 returns from the training function after 3 steps (a stale 'debug' early stop) and exits
0; rank 0 fails in its next gradient all-reduce: the survivor's error is a consequence."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "rank_left_early", "rank": 1, "fix": "every rank", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def train(model, loader, opt, rank: int) -> None:
    for step, (x, y) in enumerate(loader):
        if rank == 1 and step == 3:
            return
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)  # zoo: place
        loss.backward()
        opt.step()


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    train(model, loader, torch.optim.SGD(model.parameters(), lr=0.05), dist.get_rank())


if __name__ == "__main__":
    main()
