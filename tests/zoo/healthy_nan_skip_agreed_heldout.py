"""Healthy twin of nan_loss_skip_backward: the same corrupt record on rank 1, but the ranks
agree before skipping (an all_reduce of a "bad batch" flag), so every rank skips the same step
and the gradient all-reduces stay paired. Nothing is wrong."""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = None

BATCH = 8


def load_shard(rank: int, world: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(160, 16, generator=g)
    y = torch.randint(0, 4, (160,), generator=g)
    x, y = x[rank::world], y[rank::world]
    if rank == 1:
        x[5 * BATCH + 3, 2] = math.inf
    return TensorDataset(x, y)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    loader = DataLoader(load_shard(rank, world), batch_size=BATCH)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    running, skipped = torch.zeros(2), 0
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0])
        dist.all_reduce(bad)  # skip together or not at all
        if bad.item() > 0:
            skipped += 1
            continue
        loss.backward()
        opt.step()
        running += torch.tensor([loss.item(), 1.0])
    dist.all_reduce(running)
    if rank == 0:
        print(f"mean loss {running[0] / running[1]:.4f}, skipped {skipped}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
