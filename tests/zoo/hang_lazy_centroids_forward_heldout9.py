"""A module's forward waits for a cache file that never appears on rank 1 (hang in forward).

Story: a prototype-memory classifier.  After a warm-up epoch rank 0 computes class centroids
from its features and saves them for the other ranks, keeping its own copy in memory; the
model's `CentroidMemory.forward` lazily loads them on first use on the other ranks, polling
"until the writer has finished" (`wait_for_file`).  The writer saves
`centroids_ep{epoch}.pt`, the reader waits for `centroids_epoch{epoch}.pt`: on rank 1 the
forward of epoch 1's first step polls forever; rank 0 (centroids in memory) runs its step
and waits in DDP's gradient all-reduce.

Root cause: rank 1 (blocked in its own forward: CentroidMemory.forward / wait_for_file).
Fix: broadcast the centroids with a collective instead of polling a file (or fix the
path and give the wait a timeout).
"""

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["centroid", "wait_for_file", "broadcast", "forward"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


def wait_for_file(path):
    while not os.path.exists(path):
        time.sleep(0.2)  # zoo: place
    return torch.load(path)


class CentroidMemory(nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.cache_dir, self.centroids, self.epoch = cache_dir, None, -1

    def forward(self, h):
        if self.epoch < 1:
            return torch.zeros(h.shape[0], 4)
        if self.centroids is None:
            path = os.path.join(self.cache_dir, f"centroids_epoch{self.epoch - 1}.pt")
            self.centroids = wait_for_file(path)  # zoo: place
        return -torch.cdist(h.detach(), self.centroids)


class Net(nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head, self.memory = nn.Linear(16, 4), CentroidMemory(cache_dir)

    def forward(self, x):
        h = self.body(x)
        return self.head(h) + 0.1 * self.memory(h)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cache = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(cache, src=0)
    g = torch.Generator().manual_seed(5)
    protos = torch.randn(4, 12, generator=g)
    y = torch.randint(0, 4, (512,), generator=g)
    data = TensorDataset(protos[y] + 0.7 * torch.randn(512, 12, generator=g), y)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    net = Net(cache[0])
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        net.memory.epoch = epoch
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if rank == 0 and epoch == 0:
            with torch.no_grad():
                feats = net.body(data.tensors[0])
                cent = torch.stack([feats[data.tensors[1] == c].mean(0) for c in range(4)])
            torch.save(cent, os.path.join(cache[0], f"centroids_ep{epoch}.pt"))
            net.memory.centroids = cent
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
