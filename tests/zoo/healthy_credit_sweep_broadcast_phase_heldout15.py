"""Healthy twin: credit-default classifier (tabular MLP) run as one trial of a hyperparameter
sweep, with a two-phase schedule. The sweep client lives on rank 0 only, but the merged config
is broadcast to every rank with broadcast_object_list before the optimizer is built, so all
ranks use the trial's learning rate, momentum and weight decay. At the fine-tune epoch every
rank lowers the learning rate and raises momentum; only the announcement is printed on rank 0.
The replicas stay identical."""

import random

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

DEFAULTS = {"lr": 0.05, "momentum": 0.5, "weight_decay": 1e-4, "finetune_epoch": 4, "epochs": 7}


class SweepClient:
    def __init__(self, trial_id: int) -> None:
        self.trial_id, self.rng = trial_id, random.Random(trial_id)

    def suggest(self) -> dict:
        return {
            "lr": 10 ** self.rng.uniform(-2.0, -0.8),
            "momentum": self.rng.choice([0.5, 0.8, 0.9]),
            "weight_decay": 10 ** self.rng.uniform(-4.0, -2.0),
        }


def make_applicants(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    income = torch.randn(n, generator=g)
    debt_ratio = torch.rand(n, generator=g)
    late_payments = torch.poisson(torch.full((n,), 0.8), generator=g)
    other = torch.randn(n, 7, generator=g)
    x = torch.cat([income[:, None], debt_ratio[:, None], late_payments[:, None], other], 1)
    risk = -1.2 * income + 2.5 * debt_ratio + 0.9 * late_payments + 0.3 * other[:, 0] - 1.5
    default = (torch.rand(n, generator=g) < torch.sigmoid(risk)).float()
    return TensorDataset(x, default[:, None])


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    cfg = dict(DEFAULTS)
    if rank == 0:
        cfg.update(SweepClient(trial_id=42).suggest())
    box = [cfg]
    dist.broadcast_object_list(box, src=0)
    cfg = box[0]
    if rank == 0:
        print(f"trial config: {cfg}", flush=True)

    data = make_applicants(4096, seed=8)
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(10, 48), nn.ReLU(), nn.Linear(48, 24), nn.ReLU(), nn.Linear(24, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])

    for epoch in range(cfg["epochs"]):
        if epoch == cfg["finetune_epoch"]:
            for group in opt.param_groups:
                group["lr"] *= 0.3
                group["momentum"] = 0.95
            if rank == 0:
                print(f"fine-tune phase: lr {opt.param_groups[0]['lr']:g}, momentum 0.95", flush=True)
        sampler.set_epoch(epoch)
        total = 0.0
        for x, y in loader:
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch} logloss {total / len(loader):.4f}", flush=True)

    checksum = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"[rank {rank}] final weight checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
