"""House-price regression on regional listings with a plateau LR schedule (2-rank DDP, gloo/CPU).

What the job does
-----------------
Each rank loads the property listings of one sales region (synthetic, seeded per region:
living area, lot size, rooms, age, distance to the centre, school score, garage) and
keeps 15 % of them as a local validation set.  A small MLP predicts log-price; it is
wrapped in DDP and trained with AdamW.  A `Trainer` class runs the epochs and uses
`ReduceLROnPlateau` on the validation MSE to halve the learning rate when progress stalls.

Root cause
----------
`self.sched.step(val_loss)` is fed each rank's *local* validation loss.  The two regions'
validation curves plateau at different epochs, so the schedulers halve the learning rate
at different times and the ranks end up running AdamW with different learning rates.
DDP only averages gradients; every rank applies its own optimizer step, so with different
learning rates the replicas drift apart silently -- no error, no hang, but rank 0's
checkpoint is no longer the model rank 1 is training.

Fix
---
all_reduce (average) the validation loss across ranks before `sched.step()`, so all
schedulers see the same metric (or step the scheduler on rank 0 and broadcast the LR).

Observed (plain run, torchrun --nproc_per_node 2, OMP_NUM_THREADS=1)
--------------------------------------------------------------------
exit 0 after ~6 s, 20 epochs x 31 steps.  Rank 1's scheduler halves the LR at the end of
epoch 5 (2e-3 -> 1e-3), rank 0 keeps 2e-3 until the end of epoch 11; from epoch 6 on the
replicas train with different learning rates (rank 1 reaches 2.5e-4 at epoch 14, rank 0 at
epoch 15).  Final all_gather check (after training):
    replica check rank 0: param_sum 2.83968780 param_abs_sum 422.66386033 lr 2.50e-04
    replica check rank 1: param_sum -2.25070629 param_abs_sum 396.16843290 lr 2.50e-04
    replicas identical: False (max |diff| of param_sum 5.090e+00)
Identical in all 8 runs.
"""
import gc
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": ["weights_diverged"], "rank": None, "fix": ["all_reduce", "val_loss", "scheduler", "reducelronplateau", "sched"], "options": []}

FEATURES = ["living_sqft", "lot_sqft", "bedrooms", "bathrooms", "age_years",
            "dist_cbd_km", "school_score", "has_garage"]

log = logging.getLogger("housing")


@dataclass
class Config:
    epochs: int = 20
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 1e-4
    plateau_patience: int = 1
    plateau_factor: float = 0.5
    listings_per_region: int = 2400
    val_fraction: float = 0.15


def load_region(region, n):
    g = torch.Generator().manual_seed(2024 + region)
    u = lambda *s: torch.rand(*s, generator=g)  # noqa: E731
    living = 600 + 2400 * u(n)
    lot = living * (1.2 + 3.0 * u(n))
    beds = (living / 550 + u(n) * 1.5).floor().clamp(1, 6)
    baths = (beds / 2 + u(n)).floor().clamp(1, 4)
    age = 80 * u(n) ** 1.5
    dist_km = 2 + (25 + 10 * region) * u(n)
    school = 4 + 6 * u(n)
    garage = (u(n) < 0.6).float()
    log_price = (11.6 + 0.25 * region + 0.85 * torch.log(living / 1000) + 0.12 * torch.log(lot / living)
                 + 0.04 * baths - 0.003 * age - 0.35 * torch.log1p(dist_km / 5) + 0.05 * school
                 + 0.06 * garage + 0.12 * torch.randn(n, generator=g))
    raw = torch.stack([living, lot, beds, baths, age, dist_km, school, garage], 1)
    # fixed scaling constants from the data dictionary
    scale = torch.tensor([1000.0, 5000.0, 2.0, 1.0, 30.0, 10.0, 2.0, 1.0])
    shift = torch.tensor([1800.0, 6000.0, 3.0, 2.0, 30.0, 15.0, 7.0, 0.5])
    return (raw - shift) / scale, (log_price - 12.0).unsqueeze(1)


class PriceMLP(nn.Module):
    def __init__(self, d_in, hidden=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


class Trainer:
    def __init__(self, cfg: Config, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        torch.manual_seed(0)
        self.model = DDP(PriceMLP(len(FEATURES)))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self.opt, mode="min", factor=cfg.plateau_factor, patience=cfg.plateau_patience)
        x, y = load_region(rank, cfg.listings_per_region)
        n_val = int(cfg.val_fraction * len(x))
        self.train_x, self.train_y = x[n_val:], y[n_val:]
        self.val_x, self.val_y = x[:n_val], y[:n_val]
        self.gen = torch.Generator().manual_seed(77 + rank)

    def train_one_epoch(self):
        self.model.train()
        perm = torch.randperm(len(self.train_x), generator=self.gen)
        n_steps = len(perm) // self.cfg.batch_size
        total = 0.0
        for s in range(n_steps):
            idx = perm[s * self.cfg.batch_size:(s + 1) * self.cfg.batch_size]
            loss = F.mse_loss(self.model(self.train_x[idx]), self.train_y[idx])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            total += loss.item()
        return total / n_steps

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        mse = F.mse_loss(self.model.module(self.val_x), self.val_y).item()
        self.model.train()
        return mse

    def fit(self):
        for epoch in range(self.cfg.epochs):
            train_loss = self.train_one_epoch()
            val_loss = self.validate()
            self.sched.step(val_loss)  # zoo: place
            lr = self.opt.param_groups[0]["lr"]
            log.info("epoch %2d train_mse %.5f val_mse %.5f val_rmse_pct %.2f lr %.2e",
                     epoch, train_loss, val_loss, 100 * (math.exp(math.sqrt(val_loss)) - 1), lr)

    def replica_report(self):
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.module.parameters()]).double()
        mine = torch.stack([flat.sum(), flat.abs().sum(), torch.tensor(self.opt.param_groups[0]["lr"],
                                                                       dtype=torch.float64)])
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        if self.rank == 0:
            for r, v in enumerate(every):
                log.info("replica check rank %d: param_sum %.8f param_abs_sum %.8f lr %.2e",
                         r, v[0].item(), v[1].item(), v[2].item())
            same = all(torch.equal(every[0][:2], v[:2]) for v in every[1:])
            log.info("replicas identical: %s (max |diff| of param_sum %.3e)", same,
                     max(abs((v[0] - every[0][0]).item()) for v in every))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [r{rank}] %(message)s")
    trainer = Trainer(Config(), rank, world)
    trainer.fit()
    trainer.replica_report()
    del trainer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
