"""Healthy twin of quality_filter_uneven.py: the low-quality records are dropped from the whole
dataset first (`CleanRecords`), and only then does the DistributedSampler shard the clean set,
padding both shards to the same length (91 records, 10 batches of 10 on each rank). Every rank
runs the same number of steps, meets at the pre-checkpoint barrier and the job completes.
Nothing is wrong: no warning or error should be reported."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = None

CFG = {
    "records": 200,
    "dim": 16,
    "classes": 4,
    "batch_size": 10,
    "min_quality": 0.1,
    "lr": 0.02,
    "seed": 12,
    "ckpt_dir": tempfile.gettempdir(),
}


class SensorRecords(Dataset):
    def __init__(self, n, dim, classes, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.quality = torch.rand(n, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class CleanRecords(Dataset):
    """The records that pass the quality check."""

    def __init__(self, base, min_quality):
        self.base = base
        self.indices = [i for i in range(len(base)) if base.quality[i] >= min_quality]

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, k):
        return self.base[self.indices[k]]


def build_model(cfg):
    return nn.Sequential(
        nn.Linear(cfg["dim"], 64), nn.ReLU(),
        nn.Linear(64, 32), nn.ReLU(),
        nn.Linear(32, cfg["classes"]),
    )


def save_checkpoint(model, cfg, rank):
    dist.barrier()
    if rank == 0:
        path = os.path.join(cfg["ckpt_dir"], f"zoo_quality_{os.getpid()}.pt")
        torch.save(model.module.state_dict(), path)
        os.remove(path)


def main():
    cfg = CFG
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = SensorRecords(cfg["records"], cfg["dim"], cfg["classes"], cfg["seed"])
    clean = CleanRecords(base, cfg["min_quality"])
    sampler = DistributedSampler(clean, shuffle=True, seed=cfg["seed"])
    sampler.set_epoch(0)
    loader = DataLoader(clean, batch_size=cfg["batch_size"], sampler=sampler)
    print(f"[rank {rank}] {len(sampler)} clean records, {len(loader)} batches", flush=True)
    torch.manual_seed(cfg["seed"])
    model = DDP(build_model(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % 3 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    save_checkpoint(model, cfg, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
