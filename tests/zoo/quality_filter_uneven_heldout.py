"""Each rank takes its shard from a DistributedSampler and then drops the records whose quality
score is below `min_quality` (`ShardView.__init__`). The filter runs after sharding, so the
ranks keep different numbers of records: rank 1 keeps 89 (9 batches of 10), rank 0 keeps 92
(10 batches). Rank 1 runs out of batches first and goes on to the pre-checkpoint
`dist.barrier()`; rank 0 runs a 10th step whose gradient all-reduce nobody joins: the job
hangs at the end of the epoch.

A right diagnosis: uneven inputs, root rank 1 (ran out first: 9 steps vs 10), created by the
per-rank filtering in `ShardView.__init__` (the marked line); rank 0 waits in the gradient
all-reduce of its extra step. Fix: filter the dataset before sharding (then the
DistributedSampler pads every shard to the same length), equal shards / drop_last, or
`model.join()` (the Join context manager)."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["join", "before shard", "before sharding", "pad", "equal", "drop_last",
            "same number", "even", "filter"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

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


class ShardView(Dataset):
    """The rank's own part of the records, cleaned."""

    def __init__(self, base, indices, min_quality):
        self.base = base
        self.indices = [i for i in indices if base.quality[i] >= min_quality]  # zoo: place

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
    sampler = DistributedSampler(base, shuffle=True, seed=cfg["seed"])
    sampler.set_epoch(0)
    shard = ShardView(base, list(sampler), cfg["min_quality"])
    loader = DataLoader(shard, batch_size=cfg["batch_size"])
    print(f"[rank {rank}] {len(shard)} clean records, {len(loader)} batches", flush=True)
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
