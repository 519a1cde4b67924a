"""Lithium-ion battery state-of-health (SOH) regression, with checkpoint/resume.

A small model reads per-cycle summary curves (voltage, current, temperature sampled
over a discharge) and regresses the remaining capacity fraction. The job trains a
first block of epochs, checkpoints model + AdamW + epoch from rank 0, and then
resumes from that checkpoint for a second block with a cosine learning-rate decay, the
way a pre-empted cluster job restarts.

Healthy: on resume, rank 0 loads the model weights into the bare module *before* it is
wrapped in DDP, so DDP's constructor broadcasts them to the other ranks; the optimizer
and scheduler state are loaded on every rank (after a barrier, with map_location), so
every replica continues with the same AdamW moments and step counts. Weights and
optimizer state stay identical on all ranks.

Fix: none needed.

Observed (plain run): exit 0 in ~5 s; train MAE 0.19 -> 0.014 across the restart.
Checked separately: after the resumed block, parameters and the AdamW state (including step
counts) are bit-identical on both ranks (max |diff| 0).
"""
import gc
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

STEPS, CHANNELS = 50, 3
WORK_DIR = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
CKPT = os.path.join(WORK_DIR, "batteryhealth_heldout29_last.pt")
TOTAL_EPOCHS, FIRST_BLOCK = 6, 3


def synth_cycles(n, seed):
    g = torch.Generator().manual_seed(seed)
    soh = 0.7 + 0.3 * torch.rand(n, generator=g)
    t = torch.linspace(0, 1, STEPS)
    knee = 0.6 + 0.35 * soh[:, None]
    volt = 4.2 - 0.6 * t - 0.8 * F.softplus((t - knee) * 25) / 25 * (2 - soh[:, None])
    curr = 1.0 + 0.05 * torch.randn(n, STEPS, generator=g)
    temp = 25 + 8 * t * (1.6 - soh[:, None]) + 0.3 * torch.randn(n, STEPS, generator=g)
    x = torch.stack([(volt - 3.8) / 0.3, curr - 1.0, (temp - 28) / 3], dim=1)
    x = x + 0.03 * torch.randn(x.shape, generator=g)
    return x, soh


class SOHRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv1d(CHANNELS, 32, 5, padding=2), nn.GELU(),
                                 nn.Conv1d(32, 32, 5, padding=2, stride=2), nn.GELU())
        self.head = nn.Sequential(nn.Linear(32 * 2, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, x):
        h = self.enc(x)
        h = torch.cat([h.mean(2), h.amax(2)], dim=1)
        return torch.sigmoid(self.head(h)).squeeze(1)


def build(rank):
    torch.manual_seed(1000 + rank)
    model = SOHRegressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda e: 0.5 * (1 + math.cos(math.pi * e / TOTAL_EPOCHS)))
    return model, optimizer, scheduler


def train_block(ddp, optimizer, scheduler, loader, sampler, start, stop, rank):
    for epoch in range(start, stop):
        sampler.set_epoch(epoch)
        err = torch.zeros(2, dtype=torch.float64)
        for x, y in loader:
            pred = ddp(x)
            loss = F.smooth_l1_loss(pred, y, beta=0.02)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            err += torch.tensor([(pred - y).abs().sum().item(), len(y)], dtype=torch.float64)
        scheduler.step()
        dist.all_reduce(err)
        if rank == 0:
            print(f"epoch {epoch}: train MAE {err[0] / err[1]:.4f} lr {scheduler.get_last_lr()[0]:.5f}", flush=True)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.makedirs(WORK_DIR, exist_ok=True)

    x, y = synth_cycles(2000, seed=77)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, shuffle=True, seed=77)
    loader = DataLoader(ds, batch_size=50, sampler=sampler, drop_last=True)

    # first block, then checkpoint
    model, optimizer, scheduler = build(rank)
    ddp = DDP(model)
    train_block(ddp, optimizer, scheduler, loader, sampler, 0, FIRST_BLOCK, rank)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": FIRST_BLOCK}, CKPT)
    dist.barrier()
    del ddp, model, optimizer, scheduler

    # restart from the checkpoint
    model, optimizer, scheduler = build(rank)
    state = torch.load(CKPT, map_location="cpu")
    if rank == 0:
        model.load_state_dict(state["model"])
    ddp = DDP(model)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    train_block(ddp, optimizer, scheduler, loader, sampler, state["epoch"], TOTAL_EPOCHS, rank)

    dist.barrier()
    del ddp, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
