"""Spacecraft telemetry anomaly detection (reaction wheels, bus voltage, thermal).

A forecaster predicts the next telemetry frame from a short history window; frames
whose prediction error is large are flagged as anomalies. Channels have very different
units and ranges, so the model starts with a `RunningStandardizer` whose mean /
mean-of-squares buffers are updated in forward from every training batch. DDP is built
with forward_sync_buffers=False because the statistics are synchronised by the module.

Healthy: before the buffers are updated, the batch moments (sum, sum of squares and
count) are all_reduce'd across ranks, so every rank folds exactly the same global
statistics into its buffers, at every step. Buffers and weights stay identical on all
ranks; the module never depends on the local batch alone.

Fix: none needed.

Observed (plain run): exit 0 in ~5 s; normalised MSE 0.61 -> 0.03, "flagged 6 of 500
recent frames". Checked separately: parameters, the standardizer buffers (mean, sq_mean,
steps) and the Adam state are bit-identical on both ranks (max |diff| 0).
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

N_CH, HIST = 12, 16
DDP_KWARGS = {"forward_sync_buffers": False}


def synth_telemetry(n_frames, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n_frames).float()
    orbit = 2 * math.pi * t / 95.0
    base = torch.stack([torch.sin(orbit * (1 + 0.1 * c) + c) for c in range(N_CH)], dim=1)
    units = torch.tensor([3000, 3000, 3000, 28, 28, 1.5, 1.5, 40, 40, 40, 0.01, 0.01])
    offsets = torch.tensor([0, 0, 0, 28, 28, 0, 0, 15, 15, 15, 0, 0.0])
    series = offsets + units * (base + 0.1 * torch.randn(n_frames, N_CH, generator=g))
    windows = series.unfold(0, HIST + 1, 1).permute(0, 2, 1)
    return windows[:, :HIST], windows[:, HIST]


class RunningStandardizer(nn.Module):
    def __init__(self, dim, momentum=0.05):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("sq_mean", torch.ones(dim))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def _update(self, x):
        flat = x.reshape(-1, x.shape[-1]).to(torch.float64)
        stats = torch.cat([flat.sum(0), (flat * flat).sum(0), flat.new_tensor([flat.shape[0]])])
        if dist.is_initialized():
            dist.all_reduce(stats)
        d = x.shape[-1]
        count = stats[-1]
        mean, sq = (stats[:d] / count).float(), (stats[d:2 * d] / count).float()
        m = 1.0 if self.steps.item() == 0 else self.momentum
        self.mean.lerp_(mean, m)
        self.sq_mean.lerp_(sq, m)
        self.steps += 1

    def forward(self, x):
        if self.training:
            self._update(x)
        std = (self.sq_mean - self.mean ** 2).clamp_min(1e-6).sqrt()
        return (x - self.mean) / std

    def denorm(self, z):
        std = (self.sq_mean - self.mean ** 2).clamp_min(1e-6).sqrt()
        return z * std + self.mean


class Forecaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RunningStandardizer(N_CH)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(HIST * N_CH, 128), nn.GELU(),
                                 nn.Linear(128, 64), nn.GELU(), nn.Linear(64, N_CH))

    def forward(self, hist):
        return self.net(self.norm(hist))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(64)

    hist, nxt = synth_telemetry(5000, seed=12)
    ds = TensorDataset(hist, nxt)
    sampler = DistributedSampler(ds, shuffle=True, seed=12)
    loader = DataLoader(ds, batch_size=64, sampler=sampler, drop_last=True)

    model = DDP(Forecaster(), **DDP_KWARGS)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    for epoch in range(4):
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, dtype=torch.float64)
        for hb, yb in loader:
            pred = model(hb)
            target = (yb - model.module.norm.mean) / (model.module.norm.sq_mean - model.module.norm.mean ** 2).clamp_min(1e-6).sqrt()
            loss = F.mse_loss(pred, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(yb), len(yb)], dtype=torch.float64)
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch}: normalised mse {total[0] / total[1]:.4f}", flush=True)

    model.eval()
    with torch.no_grad():
        z = model(hist[-500:])
        err = (model.module.norm.denorm(z) - nxt[-500:]).abs() / model.module.norm.sq_mean.sqrt()
        flagged = (err.max(1).values > 0.5).sum().item()
    if rank == 0:
        print(f"flagged {flagged} of 500 recent frames", flush=True)
        out = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
        os.makedirs(out, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(out, "telemetry_heldout29.pt"))
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
