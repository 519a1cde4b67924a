"""Day-ahead electricity load forecaster whose validation report syncs the worst part of the day
first, picked from the all-reduced error (healthy twin).

The job: an MLP reads the last 24 hourly readings of a feeder and forecasts the next 24 hours.
Validation error is kept per segment of the day, one tensor per segment holding the absolute
error summed per hour plus a count: night (hours 0-5, 7 numbers), day (6-16, 12 numbers) and
evening (17-23, 8 numbers). After every epoch the report puts the worst segment first: it picks
it with `max(...)` over the segments' mean absolute error, then hands the order to a small
helper that all-reduces the segment tensors one by one.

Why it is fine: before picking, the report all-reduces one small tensor with each segment's
total error and count, in the fixed segment order, and `max(...)` runs over those global means.
Every rank picks the same worst segment from the same numbers (the worst segment changes during
training, on all ranks at once), so the segment syncs line up on every rank in every epoch.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

SEGMENTS = {"night": range(0, 6), "day": range(6, 17), "evening": range(17, 24)}
EPOCHS = 12


def make_windows(n_feeders=24, days=40, seed=0):
    """(last 24 h, next 24 h) pairs, one per feeder per day, targets starting at midnight."""
    g = torch.Generator().manual_seed(seed)
    hours = torch.arange(days * 24, dtype=torch.float32)
    xs, ys = [], []
    for _ in range(n_feeders):
        base = 1.0 + 0.5 * torch.rand(1, generator=g)
        daily = (0.6 * torch.sin(2 * math.pi * (hours - 7) / 24)
                 + 0.4 * torch.exp(-((hours % 24 - 19) ** 2) / 6.0))
        weekly = 0.15 * torch.cos(2 * math.pi * hours / (24 * 7))
        hour = hours % 24
        noise_scale = torch.where(hour < 6, 0.235, torch.where(hour >= 17, 0.22, 0.12))
        series = base + daily + weekly + noise_scale * torch.randn(hours.shape, generator=g)
        for d in range(1, days):
            xs.append(series[(d - 1) * 24:d * 24])
            ys.append(series[d * 24:(d + 1) * 24])
    return TensorDataset(torch.stack(xs), torch.stack(ys))


class SegmentError:
    def __init__(self, hours):
        self.hours = list(hours)
        self.state = torch.zeros(len(self.hours) + 1)  # abs error per hour, then count

    def update(self, pred, target):
        self.state[:-1] += (pred[:, self.hours] - target[:, self.hours]).abs().sum(0)
        self.state[-1] += target.shape[0]

    def mae(self):
        return (self.state[:-1].sum() / (self.state[-1] * len(self.hours))).item()


def sync_in_order(errors, order):
    for name in order:
        dist.all_reduce(errors[name].state)


def global_mae(errors):
    names = list(errors)
    totals = torch.stack([
        torch.stack([errors[n].state[:-1].sum(), errors[n].state[-1] * len(errors[n].hours)])
        for n in names])
    dist.all_reduce(totals)
    return {n: (totals[i, 0] / totals[i, 1]).item() for i, n in enumerate(names)}


def report(errors, epoch, rank):
    mae = global_mae(errors)
    worst = max(errors, key=lambda name: mae[name])
    order = [worst] + [name for name in errors if name != worst]
    sync_in_order(errors, order)
    if rank == 0:
        text = "  ".join(f"{name} {errors[name].mae():.4f}" for name in order)
        print(f"epoch {epoch} val mae  {text}", flush=True)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = make_windows()
    n_train = int(0.8 * len(data))
    train = TensorDataset(*data[:n_train])
    val = TensorDataset(*data[n_train:])
    train_sampler = DistributedSampler(train, shuffle=True, seed=0)
    train_loader = DataLoader(train, batch_size=32, sampler=train_sampler)
    val_loader = DataLoader(val, batch_size=64, sampler=DistributedSampler(val, shuffle=False))

    model = DDP(nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                              nn.Linear(64, 24)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    for epoch in range(EPOCHS):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            loss = F.l1_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        errors = {name: SegmentError(hours) for name, hours in SEGMENTS.items()}
        with torch.no_grad():
            for x, y in val_loader:
                pred = model(x)
                for err in errors.values():
                    err.update(pred, y)
        report(errors, epoch, rank)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
