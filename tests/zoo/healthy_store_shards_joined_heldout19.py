"""Healthy twin: each rank trains on its own stores' sales, unequal by design, under model.join().

Story: a demand-forecasting model for a retail chain.  Each rank owns a region (a
legitimate, rank-dependent shard: `REGIONS[rank]`) and streams that region's store-week rows
from its own CSV files in a temp directory, through a generator pipeline.  Regions have
different numbers of stores, so rank 0 has 10 batches per epoch and rank 1 has 14.  The
author knew: the epoch runs inside `with model.join():`, so when rank 0 runs out, DDP's Join
shadows the gradient all-reduces of rank 1's extra steps and both replicas stay identical.
After the join block every rank all-reduces its loss sum and row count (same collective,
same order, on all ranks), rank 0 prints and writes a checkpoint of `model.module` into the
temp directory, and a barrier on every rank closes the epoch.

Root cause: none (healthy).
"""

import csv
import math
import os
import random
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)

EXPECT = None

REGIONS = [("north", 28), ("south", 38)]  # (name, stores)
WEEKS = 52
LAGS = 8
BATCH = 64


def write_region(folder, region, stores):
    rng = random.Random(f"{region}-sales")
    paths = []
    for s in range(stores):
        path = os.path.join(folder, f"{region}-{s:03d}.csv")
        level = rng.uniform(50, 300)
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["week", "units"])
            for wk in range(WEEKS):
                season = 1 + 0.3 * math.sin(2 * math.pi * wk / 52)
                w.writerow([wk, round(level * season * rng.uniform(0.85, 1.15), 1)])
        paths.append(path)
    return paths


def rows(paths):
    for path in paths:
        with open(path) as f:
            units = [float(r["units"]) for r in csv.DictReader(f)]
        scale = max(units)
        for t in range(LAGS, WEEKS, 2):
            yield [u / scale for u in units[t - LAGS:t]], units[t] / scale


def batches(paths, size=BATCH):
    buf = []
    for x, y in rows(paths):
        buf.append((x, y))
        if len(buf) == size:
            yield torch.tensor([b[0] for b in buf]), torch.tensor([b[1] for b in buf])
            buf = []
    if buf:
        yield torch.tensor([b[0] for b in buf]), torch.tensor([b[1] for b in buf])


class DemandNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(LAGS, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                 nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1) + x[:, -1]


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    region, stores = REGIONS[rank]
    with tempfile.TemporaryDirectory(prefix=f"demand-{region}-") as folder:
        paths = write_region(folder, region, stores)
        torch.manual_seed(0)
        model = DDP(DemandNet())
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for epoch in range(4):
            random.Random(epoch).shuffle(paths)
            loss_sum, n = torch.zeros(1), torch.zeros(1)
            with model.join():
                for x, y in batches(paths):
                    loss = F.mse_loss(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    loss_sum += loss.detach() * len(y)
                    n += len(y)
            totals = torch.cat([loss_sum, n])
            dist.all_reduce(totals)
            if rank == 0:
                print(f"epoch {epoch}: mse {totals[0].item() / totals[1].item():.5f} "
                      f"over {int(totals[1].item())} rows", flush=True)
                torch.save(model.module.state_dict(), os.path.join(folder, f"demand-{epoch}.pt"))
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
