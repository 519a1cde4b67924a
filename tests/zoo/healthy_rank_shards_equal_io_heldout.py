"""HEALTHY: each rank reads a different (rank-seeded) shard with simulated I/O latency.

Every rank builds its own `RemoteShard` from a rank-dependent seed and a
rank-dependent "file list" -- but the shards have the same number of samples
and the same per-sample cost.  `__getitem__` sleeps 1 ms per sample on every
rank to emulate object-store reads (the same for both ranks, ~16 ms per
batch), and a validation pass runs on every rank on its own validation shard
with an all_reduce of the summed loss.  Different data per rank and sleeping
in the data path look suspicious, but the work is balanced and every rank
issues the same collectives.  Exits 0.

Expected: no warning, no error.
"""
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

EXPECT = None


class RemoteShard(Dataset):
    def __init__(self, rank, split, n):
        self.files = [f"s3://bucket/{split}/part-{rank:02d}-{i:04d}.bin" for i in range(n)]
        self.seed = 1000 * rank + (0 if split == "train" else 1)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        time.sleep(0.001)                         # emulated object-store latency
        g = torch.Generator().manual_seed(self.seed * 10007 + i)
        x = torch.randn(12, generator=g)
        return x, (x[:6].sum() > x[6:].sum()).long()


@torch.no_grad()
def validate(model, loader):
    model.eval()
    s = torch.zeros(2)
    for x, y in loader:
        s[0] += nn.functional.cross_entropy(model(x), y, reduction="sum")
        s[1] += len(y)
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Dropout(0.1), nn.Linear(48, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    train = DataLoader(RemoteShard(rank, "train", 16 * 25), batch_size=16, shuffle=True)
    val = DataLoader(RemoteShard(rank, "val", 64), batch_size=32)
    for epoch in range(2):
        for x, y in train:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        vl = validate(model, val)
        if rank == 0:
            print(f"epoch {epoch} val loss {vl:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
