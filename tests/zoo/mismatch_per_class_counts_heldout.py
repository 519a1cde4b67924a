"""Per-class metric tensors of different lengths on different ranks (collective mismatch).

The user's dataset is stored sorted by class and is split into contiguous
shards per rank (`ShardedByRange`), so rank 0 only ever sees classes 0-2 and
rank 1 only classes 2-4.  After each epoch `per_class_accuracy()` counts hits
per class with `torch.bincount(labels)` -- without `minlength` -- and
all_reduces the counts.  The tensor is 3 long on rank 0 and 5 long on rank 1,
so the all_reduce has different sizes on the two ranks.

Root cause: no single rank; the helper produces a data-dependent shape on
every rank.
Right diagnosis: collective mismatch (all_reduce with different sizes) in
per_class_accuracy().
Fix: `torch.bincount(..., minlength=num_classes)` so every rank reduces a
tensor of the same size (and/or shard the data randomly).
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": ["minlength", "same size", "same shape", "shape", "pad", "num_classes"],
    "names": ["per_class_accuracy"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

NUM_CLASSES = 5


class ShardedByRange(Dataset):
    """Rank r reads rows [r*n/W, (r+1)*n/W) of a class-sorted table."""

    def __init__(self, rank, world, n=1000):
        g = torch.Generator().manual_seed(3)
        y = torch.arange(n) * NUM_CLASSES // n           # sorted labels 0..4
        centers = torch.randn(NUM_CLASSES, 16, generator=g) * 2
        x = centers[y] + torch.randn(n, 16, generator=g)
        lo, hi = rank * n // world, (rank + 1) * n // world
        self.x, self.y = x[lo:hi], y[lo:hi]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def per_class_accuracy(model, loader):
    hits, totals = None, None
    with torch.no_grad():
        for x, y in loader:
            pred = model(x).argmax(1)
            h = torch.bincount(y[pred == y])
            t = torch.bincount(y)
            hits = h if hits is None else _add(hits, h)
            totals = t if totals is None else _add(totals, t)
    stats = torch.stack([_pad(hits, len(totals)), totals]).float()
    dist.all_reduce(stats)  # zoo: place
    return stats[0] / stats[1].clamp(min=1)


def _pad(t, n):
    return torch.cat([t, t.new_zeros(n - len(t))]) if len(t) < n else t


def _add(a, b):
    n = max(len(a), len(b))
    return _pad(a, n) + _pad(b, n)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, NUM_CLASSES)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ds = ShardedByRange(rank, world)
    loader = DataLoader(ds, batch_size=25, shuffle=True)
    for epoch in range(3):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        acc = per_class_accuracy(model.module, loader)
        if rank == 0:
            print(f"epoch {epoch} per-class acc {acc.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
