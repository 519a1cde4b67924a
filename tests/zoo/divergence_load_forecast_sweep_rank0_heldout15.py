"""Hourly electricity-load forecaster (MLP on the last 24 hours) run as one trial of a
hyperparameter sweep. The sweep client is only set up on rank 0 (next to the experiment
tracker), and the trial's suggested learning rate and weight decay are merged into the config
there and never broadcast, so rank 0 builds AdamW with the trial's values and rank 1 with the
defaults. No error, no hang; DDP averages the gradients as usual, but each rank applies them with
its own optimizer settings and the replicas' weights differ from the first step on."""

import math
import random

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": [],
    "options": [],
    "names": [["learning rate", "lr ", "lr=", "'lr'", "weight decay", "weight_decay", "hyperparameter"]],
    "never": [],
}

DEFAULTS = {"lr": 1e-3, "weight_decay": 1e-4, "hidden": 64, "epochs": 6, "batch_size": 64}
LAGS = 24


class SweepClient:
    """Stand-in for a sweep agent: hands out log-uniform suggestions for one trial."""

    def __init__(self, trial_id: int) -> None:
        self.trial_id = trial_id
        self.rng = random.Random(trial_id)

    def suggest(self) -> dict:
        return {
            "lr": 10 ** self.rng.uniform(-3.0, -1.7),
            "weight_decay": 10 ** self.rng.uniform(-3.0, -1.0),
        }


def make_load_series(hours: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(hours, dtype=torch.float32)
    daily = torch.sin(2 * math.pi * t / 24) + 0.4 * torch.sin(4 * math.pi * t / 24)
    weekly = 0.5 * torch.sin(2 * math.pi * t / (24 * 7))
    load = daily + weekly + 0.15 * torch.randn(hours, generator=g)
    windows = load.unfold(0, LAGS + 1, 1)
    return TensorDataset(windows[:, :LAGS], windows[:, LAGS:])


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(LAGS, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    cfg = dict(DEFAULTS)
    if rank == 0:
        sweep = SweepClient(trial_id=17)
        cfg.update(sweep.suggest())  # zoo: place
        print(f"trial {sweep.trial_id} config: {cfg}", flush=True)

    data = make_load_series(24 * 120, seed=9)
    sampler = DistributedSampler(data, shuffle=True, seed=2)
    loader = DataLoader(data, batch_size=cfg["batch_size"], sampler=sampler)
    model = DDP(build_model(cfg["hidden"]))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        total = 0.0
        for lags, target in loader:
            loss = nn.functional.mse_loss(model(lags), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch} train mse {total / len(loader):.4f}", flush=True)

    checksum = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"[rank {rank}] final weight checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
