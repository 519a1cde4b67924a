"""Day-ahead electricity load forecasting for substations (healthy).

A 1-D CNN + MLP forecasts the next 24 hourly loads of a substation from the previous 72 hours
plus calendar features (day of week, holiday flag). Each rank trains on its own substations.
A MetricBank accumulates running sums (loss, MAE, MAPE, peak-hour error, sample count) on every
rank, and every 20 steps sync_metrics() all_reduces them; rank 0 alone prints the averages.
This is the pattern that breaks when one rank has an extra metric key -- but here every rank
records every key on every step (peak-hour error is recorded as 0 with count 0 when a batch has
no peak hours), and the keys are all_reduced one scalar at a time in sorted order, so every rank
issues exactly the same six all_reduce calls with the same shapes at the same step. The
rank-0-only part is just a print.

Root cause: none (healthy job).
Plain run (measured): exits 0 in ~6 s; global MSE 0.205 -> 0.008 over 160 steps; parameter
checksums rank 0 1923.805870 == rank 1 1923.805870.
Fix: nothing to fix.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None

HIST, HORIZON = 72, 24
PEAK_HOURS = (17, 18, 19, 20)


def synth_substations(n_days, seed):
    g = torch.Generator().manual_seed(seed)
    hours = torch.arange(n_days * 24).float()
    daily = (
        0.6
        + 0.3 * torch.sin(2 * math.pi * (hours % 24 - 6) / 24)
        + 0.25 * torch.exp(-(((hours % 24) - 19) ** 2) / 4)
    )
    dow = (hours // 24) % 7
    weekly = torch.where(dow >= 5, torch.tensor(0.8), torch.tensor(1.0))
    holiday = (torch.rand(n_days, generator=g) < 0.04).float().repeat_interleave(24)
    load = daily * weekly * (1 - 0.2 * holiday) * (1 + 0.4 * torch.rand(1, generator=g))
    load = load + 0.03 * torch.randn(load.shape, generator=g)
    xs, cal, ys, start_hour = [], [], [], []
    for s in range(0, len(load) - HIST - HORIZON, 5):
        xs.append(load[s : s + HIST])
        ys.append(load[s + HIST : s + HIST + HORIZON])
        h0 = s + HIST
        cal.append(torch.cat([F.one_hot(dow[h0].long(), 7).float(), holiday[h0 : h0 + 1]]))
        start_hour.append(h0 % 24)
    return torch.stack(xs), torch.stack(cal), torch.stack(ys), torch.tensor(start_hour)


class LoadForecaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(1, 16, 5, padding=2), nn.ReLU(), nn.Conv1d(16, 16, 5, stride=2, padding=2), nn.ReLU()
        )
        self.mlp = nn.Sequential(nn.Linear(16 * 36 + 8, 128), nn.ReLU(), nn.Linear(128, HORIZON))

    def forward(self, x, cal):
        h = self.conv(x[:, None]).flatten(1)
        return self.mlp(torch.cat([h, cal], 1))


class MetricBank:
    KEYS = ("abs_err", "ape", "loss", "n", "peak_abs_err", "peak_n")

    def __init__(self):
        self.sums = {k: 0.0 for k in self.KEYS}

    def update(self, loss, pred, y, start_hour):
        hour_of = (start_hour[:, None] + torch.arange(HORIZON)[None, :]) % 24
        peak = torch.zeros_like(y, dtype=torch.bool)
        for h in PEAK_HOURS:
            peak |= hour_of == h
        err = (pred - y).abs()
        self.sums["loss"] += loss.item() * y.numel()
        self.sums["abs_err"] += err.sum().item()
        self.sums["ape"] += (err / y.abs().clamp(min=1e-3)).sum().item()
        self.sums["n"] += y.numel()
        self.sums["peak_abs_err"] += err[peak].sum().item()  # 0.0 when no peak hours in the batch
        self.sums["peak_n"] += peak.sum().item()

    def sync_and_reset(self):
        tot = {}
        for k in sorted(self.sums):
            t = torch.tensor(self.sums[k], dtype=torch.float64)
            dist.all_reduce(t)
            tot[k] = t.item()
        self.sums = {k: 0.0 for k in self.KEYS}
        return {
            "mse": tot["loss"] / tot["n"],
            "mae": tot["abs_err"] / tot["n"],
            "mape%": 100 * tot["ape"] / tot["n"],
            "peak_mae": tot["peak_abs_err"] / max(tot["peak_n"], 1),
        }


def param_checksum(model):
    return sum(p.detach().double().abs().sum().item() for p in model.parameters())


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, cal, y, sh = synth_substations(200, seed=60 + rank)
    torch.manual_seed(0)
    model = DDP(LoadForecaster())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    bank = MetricBank()
    bs = 24
    for step in range(1, 161):
        i = (step * bs) % (len(x) - bs)
        pred = model(x[i : i + bs], cal[i : i + bs])
        loss = F.mse_loss(pred, y[i : i + bs])
        opt.zero_grad()
        loss.backward()
        opt.step()
        bank.update(loss.detach(), pred.detach(), y[i : i + bs], sh[i : i + bs])
        if step % 20 == 0:
            m = bank.sync_and_reset()
            if rank == 0:
                print(f"step {step} " + " ".join(f"{k}={v:.4f}" for k, v in m.items()), flush=True)
    print(f"rank {rank} param checksum {param_checksum(model):.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
