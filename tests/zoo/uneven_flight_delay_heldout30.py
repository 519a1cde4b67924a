"""Arrival-delay prediction for domestic flights, DDP on CPU.

What the job does
    The flights table is stored as one file per month; each rank reads "its"
    months (month % world_size == rank), standardises the features and trains a
    delay regressor (minutes, Huber loss) on its own shard with a shuffling
    DataLoader. At the end of every epoch rank 0 writes a checkpoint and all
    ranks meet at a barrier before the next epoch.

Root cause
    Sharding by month gives the ranks different numbers of rows: the odd months
    (Jan, Mar, May, Jul, Sep, Nov) have 184 days, the even months 181. At 24
    flights a day and batch 64, rank 1 has 69 batches per epoch and rank 0 has 68.
    Rank 0 finishes the epoch and waits in the checkpoint barrier while rank 1
    runs its 69th step and waits in that step's gradient all-reduce, which no
    other rank joins. The job hangs at the end of epoch 0.

Fix
    Shard rows, not months, with a DistributedSampler (it pads to equal length)
    or truncate every shard to the minimum number of batches, or wrap the loop
    in DDP's Join context manager (model.join()).

Observed (plain run)
    `timeout 90` -> rc 124 (hung until killed). Startup lines:
    "rank 0: months [2, 4, 6, 8, 10, 12] rows 4344 batches 68",
    "rank 1: months [1, 3, 5, 7, 9, 11] rows 4416 batches 69", then
    "epoch 0 huber 129.346 (0.2s)" from rank 0 and nothing more. A faulthandler
    dump 12 s in shows rank 1 inside loss.backward() of its 69th step (the
    gradient all-reduce) while rank 0 sits in the epoch-end dist.barrier().
"""
import calendar
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": ["uneven_inputs", "hang"],
    "rank": 1,
    "fix": ["Join", "join", "DistributedSampler", "equal", "same number", "truncate", "pad"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

YEAR = 2023
FLIGHTS_PER_DAY = 24
N_CARRIERS = 9
N_AIRPORTS = 40


def read_month(month):
    """Stand-in for pd.read_parquet(f'flights/{YEAR}-{month:02d}.parquet')."""
    days = calendar.monthrange(YEAR, month)[1]
    n = days * FLIGHTS_PER_DAY
    rng = np.random.default_rng(YEAR * 100 + month)
    dep_hour = rng.integers(5, 23, size=n)
    carrier = rng.integers(0, N_CARRIERS, size=n)
    origin = rng.integers(0, N_AIRPORTS, size=n)
    distance = rng.gamma(3.0, 300.0, size=n)
    dow = (np.repeat(np.arange(days), FLIGHTS_PER_DAY) + month) % 7
    winter = float(month in (12, 1, 2))
    delay = (4 + 0.9 * (dep_hour - 5) + 6 * winter + 3 * (carrier % 3) + 0.004 * distance
             + 2 * (dow >= 5) + rng.gamma(1.5, 8.0, size=n) - 10)
    month_sin = np.full(n, np.sin(2 * np.pi * month / 12))
    month_cos = np.full(n, np.cos(2 * np.pi * month / 12))
    cols = np.stack([
        dep_hour / 23.0, month_sin, month_cos,
        dow / 6.0, np.log1p(distance) / 8.0, np.full(n, winter),
    ], axis=1)
    onehot_c = np.eye(N_CARRIERS)[carrier]
    onehot_o = np.eye(N_AIRPORTS)[origin]
    x = np.concatenate([cols, onehot_c, onehot_o], axis=1).astype(np.float32)
    return x, delay.astype(np.float32)


class DelayNet(nn.Module):
    def __init__(self, d_in):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, 128), nn.SiLU(), nn.Linear(128, 64), nn.SiLU())
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        return self.out(self.body(x)).squeeze(-1)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(31)
    ckpt_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "flight_delay")
    os.makedirs(ckpt_dir, exist_ok=True)

    my_months = [m for m in range(1, 13) if m % world == rank]  # zoo: place
    parts = [read_month(m) for m in my_months]
    x = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))
    print(f"rank {rank}: months {my_months} rows {len(y)} batches {len(loader)}", flush=True)

    model = DDP(DelayNet(x.shape[1]))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for epoch in range(3):
        t0 = time.time()
        total = 0.0
        for xb, yb in loader:
            loss = F.huber_loss(model(xb), yb, delta=15.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch} huber {total / len(loader):.3f} ({time.time() - t0:.1f}s)", flush=True)
            torch.save(model.module.state_dict(), os.path.join(ckpt_dir, f"delaynet_e{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
