"""Per-pixel land-cover classifier from 10-band multispectral reflectance (2-rank DDP, gloo/CPU).

What the job does
-----------------
A north-south strip of satellite tiles is rasterised into pixels (synthetic, seeded):
10 spectral bands, 7 land-cover classes (water, forest, cropland, grassland, urban, bare,
snow/ice).  The tiler emits pixels in scan order, i.e. sorted south -> north, and the
script shards them contiguously: rank 0 gets the southern half, rank 1 the northern half.
Each rank keeps the last 15 % of its shard as validation.  An MLP is trained with
cross-entropy; after every epoch the script computes per-class recall by summing class
support and hit counts over ranks with `all_reduce`.

Root cause
----------
The per-class counters are built with `torch.bincount(y)` without `minlength`, so their
length is "largest label present on this rank + 1".  Snow/ice only exists north of ~57.5 N,
i.e. only in rank 1's shard: rank 0's support vector has 6 entries, rank 1's has 7.  The
two ranks therefore enter the same `all_reduce` with differently shaped tensors at the
first evaluation (after one full epoch of training).

Fix
---
`torch.bincount(y, minlength=NUM_CLASSES)` (and the same for the hit counter), so every
rank reduces a fixed-size vector.

Observed (plain run, torchrun --nproc_per_node 2, OMP_NUM_THREADS=1)
--------------------------------------------------------------------
exit 1 after ~3.5-4.8 s (first evaluation, after 79 training steps).  Rank 1 aborts
(SIGABRT, exitcode -6) inside gloo:
    terminate called after throwing an instance of 'gloo::EnforceNotMet'
      what():  [enforce fail at .../gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes.
      16 vs 8. Received data size doesn't match expected size. Is there a distributed collective
      mismatch in your code?
and rank 0 then fails in the same `dist.all_reduce(support)` with "Connection reset by peer";
torchrun reports rank 1 as the first failure.  No epoch line is ever printed.
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {"kind": ["collective_mismatch"], "rank": None, "fix": ["bincount", "minlength", "num_classes"], "options": []}

CLASSES = ["water", "forest", "cropland", "grassland", "urban", "bare", "snow_ice"]
NUM_CLASSES = len(CLASSES)
BANDS = 10


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pixels", type=int, default=24000)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    return p.parse_args()


def build_strip(n_pixels, seed=5):
    """Pixels of a north-south strip in tiler scan order (south -> north)."""
    g = torch.Generator().manual_seed(seed)
    lat = torch.sort(35.0 + 30.0 * torch.rand(n_pixels, generator=g)).values
    signatures = 1.5 * torch.randn(NUM_CLASSES, BANDS, generator=g)
    prior = torch.randn(n_pixels, NUM_CLASSES, generator=g)
    prior[:, 1] += (lat - 45.0) / 10.0          # more forest further north
    prior[:, 2] += (50.0 - lat) / 8.0           # cropland in the south
    snow_possible = lat > 57.5
    prior[:, 6] = torch.where(snow_possible, prior[:, 6] + 1.5, torch.full_like(lat, -30.0))
    y = prior.argmax(1)
    x = signatures[y] + 0.9 * torch.randn(n_pixels, BANDS, generator=g)
    x = x + 0.02 * (lat[:, None] - 50.0)        # mild illumination drift with latitude
    return x, y


def make_model():
    return nn.Sequential(
        nn.Linear(BANDS, 64), nn.ReLU(),
        nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, NUM_CLASSES),
    )


@torch.no_grad()
def per_class_recall(model, loader):
    model.eval()
    preds, labels = [], []
    for xb, yb in loader:
        preds.append(model(xb).argmax(1))
        labels.append(yb)
    model.train()
    pred, y = torch.cat(preds), torch.cat(labels)
    support = torch.bincount(y)  # zoo: place
    hits = torch.bincount(y[pred == y], minlength=support.numel())
    dist.all_reduce(support)
    dist.all_reduce(hits)
    return hits.double() / support.clamp(min=1)


def main():
    args = parse_args()
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    x, y = build_strip(args.pixels)
    per_rank = len(y) // world
    lo = rank * per_rank
    x_loc, y_loc = x[lo:lo + per_rank], y[lo:lo + per_rank]
    n_val = int(0.15 * per_rank)
    train_ds = TensorDataset(x_loc[:-n_val], y_loc[:-n_val])
    val_ds = TensorDataset(x_loc[-n_val:], y_loc[-n_val:])
    g = torch.Generator().manual_seed(100 + rank)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, generator=g, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=512)
    print(f"[rank {rank}] {len(train_ds)} train / {len(val_ds)} val pixels, "
          f"{len(train_dl)} steps per epoch", flush=True)

    model = DDP(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    crit = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        t0 = time.time()
        tot, n = 0.0, 0
        for xb, yb in train_dl:
            loss = crit(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += loss.item()
            n += 1
        recall = per_class_recall(model, val_dl)
        if rank == 0:
            pretty = " ".join(f"{c}={r:.2f}" for c, r in zip(CLASSES, recall.tolist()))
            print(f"epoch {epoch} loss {tot / n:.4f} ({time.time() - t0:.1f}s) recall: {pretty}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
