"""set_epoch is called on the DataLoader (a no-op) instead of the sampler.

The training loop was copied from a codebase whose loaders were wrappers
exposing `set_epoch()`.  Here the loader is a plain torch DataLoader, so the
guarded call `if hasattr(train_loader, "set_epoch"): train_loader.set_epoch(epoch)`
silently does nothing, and the DistributedSampler (shuffle=True) is never told
the epoch.  Every epoch each rank sees exactly the same sample order as in
epoch 0.  Training runs fine otherwise (with a cosine scheduler, gradient
clipping and a per-epoch all-rank validation); there is no error.

Root cause: no single rank (all ranks reuse the epoch-0 permutation).
Right diagnosis: DistributedSampler with shuffle=True but set_epoch never
called across 5 epochs.
Fix: call `train_sampler.set_epoch(epoch)` (train_loader.sampler.set_epoch)
at the start of every epoch.
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = {"kind": None, "rank": None, "fix": ["set_epoch"], "options": []}


class Regression(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 12, generator=g)
        self.y = torch.sin(self.x[:, :3].sum(1, keepdim=True)) + 0.05 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def build_loaders(rank, world):
    train = Regression(512, 0)
    val = Regression(128, 1)
    train_loader = DataLoader(train, batch_size=32,
                              sampler=DistributedSampler(train, world, rank, shuffle=True))
    val_loader = DataLoader(val, batch_size=64,
                            sampler=DistributedSampler(val, world, rank, shuffle=False))
    return train_loader, val_loader


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    tot = torch.zeros(2)
    for x, y in loader:
        tot[0] += nn.functional.mse_loss(model(x), y, reduction="sum")
        tot[1] += len(x)
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 1)))
    train_loader, val_loader = build_loaders(rank, world)
    epochs = 5
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / (epochs * len(train_loader)))))
    for epoch in range(epochs):
        if hasattr(train_loader, "set_epoch"):
            train_loader.set_epoch(epoch)
        for x, y in train_loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        val = evaluate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch} train {loss.item():.4f} val {val:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
