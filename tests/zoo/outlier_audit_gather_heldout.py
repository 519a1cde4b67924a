"""A training loop with a data-quality auditor. After each step, `DataAuditor.observe` looks at
the rank's own batch; when the batch holds an outlier (a feature beyond `outlier_z`) it collects
every rank's worst value with `dist.all_gather` to log how widespread the problem is. The
condition is computed from local data only: the two outlier records sit in rank 1's shard, so
rank 1 alone enters the all_gather while rank 0 moves on into the next step's gradient
all-reduce. Rank 1 made the extra collective: the job hangs (or gloo aborts on the mismatch).

A right diagnosis: root rank 1, the extra all_gather in `DataAuditor.observe` (the marked
line); the ranks disagree on the collective at that sequence number (all_gather vs the DDP
gradient all-reduce). Fix: make the decision on every rank (all_reduce the flag first) or
gather on every rank unconditionally / only from rank-agnostic conditions."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["every rank", "all ranks", "each rank", "same collective", "unconditional",
            "rank-dependent", "all_reduce the flag", "agree"],
    "names": ["all_gather"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

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
        if worst.item() > self.z:
            values = [torch.zeros(()) for _ in range(self.world_size)]
            dist.all_gather(values, worst)  # zoo: place
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
            print(f"epoch {epoch} loss {loss.item():.4f} audits {len(auditor.reports)}", flush=True)


def main():
    dist.init_process_group("gloo")
    try:
        train(CFG)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
