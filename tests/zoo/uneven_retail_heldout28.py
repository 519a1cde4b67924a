"""Retail demand forecasting: predict the next 7 days of unit sales per store from the
previous 28 days plus calendar features, trained with DDP (gloo, CPU).

What the job does
    Rank 0 exports one CSV per store (daily sales since the store opened) under
    $TMPDIR/ddpdoctor-zoo/retail_demand/, then everyone meets at a barrier.  Each rank
    reads "its" stores, sorted_files[rank::world_size], cuts sliding windows
    (28 in -> 7 out, stride 7) and trains an MLP forecaster for 3 epochs.  At the end of
    every epoch all ranks meet at a barrier before rank 0 writes a checkpoint.

Root cause
    Stores opened on different dates, so the CSVs have very different lengths and the
    by-file split gives rank 0 many more windows than rank 1 (12 vs 7 batches per
    epoch with these files).  Nothing evens this out (no DistributedSampler padding,
    no Join), so after its 7th batch rank 1 goes to the end-of-epoch dist.barrier()
    while rank 0 is in the gradient all-reduce of its 8th batch: the ranks wait in
    different collectives and the job hangs at the end of epoch 0.

Fix
    Handle uneven inputs: wrap the epoch in `with Join([model]):` (DDP's join
    support), or pool all windows and shard them with DistributedSampler (which
    pads to equal length), or cap every rank at the global minimum number of batches
    (all_reduce MIN) / balance the shards by rows rather than by file.

Observed (plain run: OMP_NUM_THREADS=1 timeout 90 torchrun --standalone --nproc_per_node 2)
    Hangs.  Exit code 124 (killed by `timeout 90` after 90 s).  Output:
    "rank 1: 4 stores, 195 windows, 7 batches/epoch" and
    "rank 0: 4 stores, 353 windows, 12 batches/epoch", then nothing until torchrun's
    "Received 15 death signal, shutting down workers" on timeout; no epoch line.
    A faulthandler stack dump during the hang showed rank 1 in dist.barrier() at
    the end of epoch 0 (after its 7 batches) and rank 0 inside loss.backward() of
    its 8th batch, waiting for the gradient all-reduce.
"""
import csv
import gc
import glob
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

EXPECT = {
    "kind": ["uneven_inputs", "hang"],
    "rank": None,
    "fix": ["Join", "join", "DistributedSampler", "equal", "pad"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

SEED = 8080
DATA_DIR = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "retail_demand")
# days of history per store (stores opened at different dates)
STORE_HISTORY = {"S01": 730, "S02": 420, "S03": 690, "S04": 365,
                 "S05": 560, "S06": 300, "S07": 610, "S08": 400}
LOOKBACK, HORIZON, STRIDE = 28, 7, 7
BATCH = 32
EPOCHS = 3


def export_store_csvs():
    os.makedirs(DATA_DIR, exist_ok=True)
    g = torch.Generator().manual_seed(SEED)
    for store, days in STORE_HISTORY.items():
        level = 40 + 80 * float(torch.rand(1, generator=g))
        t = torch.arange(days, dtype=torch.float32)
        weekly = 1.0 + 0.25 * torch.sin(2 * math.pi * t / 7.0)
        yearly = 1.0 + 0.15 * torch.sin(2 * math.pi * t / 365.0)
        promo = (torch.rand(days, generator=g) < 0.05).float()
        demand = level * weekly * yearly * (1 + 0.6 * promo)
        sales = torch.poisson(demand, generator=g)
        with open(os.path.join(DATA_DIR, f"{store}.csv"), "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["day", "dow", "promo", "units"])
            for d in range(days):
                w.writerow([d, d % 7, int(promo[d]), int(sales[d])])


def read_store(path):
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    units = torch.tensor([float(r["units"]) for r in rows])
    promo = torch.tensor([float(r["promo"]) for r in rows])
    dow = torch.tensor([int(r["dow"]) for r in rows])
    return units, promo, dow


class StoreWindows(Dataset):
    def __init__(self, paths):
        self.x, self.y = [], []
        for p in paths:
            units, promo, dow = read_store(p)
            scale = units.mean() + 1.0
            for s in range(0, len(units) - LOOKBACK - HORIZON + 1, STRIDE):
                hist = units[s:s + LOOKBACK] / scale
                fut_promo = promo[s + LOOKBACK:s + LOOKBACK + HORIZON]
                fut_dow = F.one_hot(dow[s + LOOKBACK], 7).float()
                self.x.append(torch.cat([hist, fut_promo, fut_dow]))
                self.y.append(units[s + LOOKBACK:s + LOOKBACK + HORIZON] / scale)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, idx):
        return self.x[idx], self.y[idx]


class DemandMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(LOOKBACK + HORIZON + 7, 128), nn.ReLU(),
                                 nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, HORIZON))

    def forward(self, x):
        return self.net(x)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)

    if rank == 0:
        export_store_csvs()
    dist.barrier()

    files = sorted(glob.glob(os.path.join(DATA_DIR, "S*.csv")))
    my_files = files[rank::world]  # zoo: place
    ds = StoreWindows(my_files)
    g = torch.Generator().manual_seed(SEED + rank)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, generator=g)
    print(f"rank {rank}: {len(my_files)} stores, {len(ds)} windows, {len(loader)} batches/epoch", flush=True)

    model = DDP(DemandMLP())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    for epoch in range(EPOCHS):
        total = 0.0
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item()
        dist.barrier()
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(DATA_DIR, f"demand_mlp_e{epoch}.pt"))
            print(f"epoch {epoch}: mse {total / len(loader):.4f}", flush=True)

    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
