"""A guard against bad batches: when the loss is not finite the step is skipped with `continue`,
on the rank that saw it only. Rank 1's shard holds a corrupt sample (inf) in its 6th batch, so
rank 1 skips one backward: from there its gradient all-reduces pair with rank 0's previous
step's, and the ranks only part at the end of the epoch, where rank 1's metric all-reduce meets
rank 0's last gradient all-reduce. The root is rank 1's skipped backward at its 6th step."""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": None, "rank": 1, "fix": ["every rank", "all ranks", "all_reduce"], "names": ["backward"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

BATCH = 8


def load_shard(rank: int, world: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(160, 16, generator=g)
    y = torch.randint(0, 4, (160,), generator=g)
    x, y = x[rank::world], y[rank::world]
    if rank == 1:
        x[5 * BATCH + 3, 2] = math.inf  # a corrupt record in this shard
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
        if not torch.isfinite(loss):  # zoo: place
            skipped += 1
            continue  # zoo: place
        loss.backward()
        opt.step()
        running += torch.tensor([loss.item(), 1.0])
    dist.all_reduce(running)
    if rank == 0:
        print(f"mean loss {running[0] / running[1]:.4f}, skipped {skipped}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
