"""Healthy twin of outlier_audit_gather.py: `DataAuditor.observe` first agrees on the decision
(every rank all-reduces its local outlier flag with MAX), so when rank 1's batch holds an
outlier both ranks enter the all_gather together. Every rank issues the same collectives in the
same order and the job completes. Nothing is wrong: no warning or error should be reported."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

CFG = {
    "n_records": 192,
    "features": 12,
    "classes": 3,
    "batch_size": 8,
    "lr": 0.03,
    "epochs": 1,
    "outlier_z": 6.0,
    "seed": 17,
}


def build_records(cfg):
    g = torch.Generator().manual_seed(cfg["seed"])
    x = torch.randn(cfg["n_records"], cfg["features"], generator=g)
    y = torch.randint(0, cfg["classes"], (cfg["n_records"],), generator=g)
    # two corrupted sensor readings; with shuffle=False the sampler gives odd indices to rank 1
    x[85, 3] = 40.0
    x[151, 7] = -55.0
    return TensorDataset(x, y)


class Classifier(nn.Module):
    def __init__(self, features, classes):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU())
        self.out = nn.Linear(48, classes)

    def forward(self, x):
        return self.out(self.body(x))


class DataAuditor:
    def __init__(self, world_size, z):
        self.world_size = world_size
        self.z = z
        self.reports = []

    def observe(self, step, xb):
        worst = xb.abs().max()
        flag = torch.tensor(float(worst.item() > self.z))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            values = [torch.zeros(()) for _ in range(self.world_size)]
            dist.all_gather(values, worst)
            self.reports.append((step, [v.item() for v in values]))


def train(cfg):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg["seed"])
    ds = build_records(cfg)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler)
    model = DDP(Classifier(cfg["features"], cfg["classes"]))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    auditor = DataAuditor(world, cfg["outlier_z"])
    step = 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            auditor.observe(step, xb)
            step += 1
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} audits {auditor.reports}", flush=True)


def main():
    dist.init_process_group("gloo")
    try:
        train(CFG)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
