"""Healthy: the standard idiom for preparing a dataset once. Rank 0 "downloads" and tokenizes
the corpus into a cache file (about 4 s) while the other ranks wait at the first barrier, then
every rank reads the cache and trains. A one-time setup wait before step 0 is not a problem:
no warning, no error."""

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


def prepare_corpus(path: str) -> None:
    g = torch.Generator().manual_seed(5)
    docs = []
    for _ in range(20):  # one shard "downloaded" at a time
        docs.append(torch.randint(0, 100, (16, 12), generator=g))
        time.sleep(0.2)
    tokens = torch.cat(docs)
    torch.save({"tokens": tokens, "labels": tokens.sum(1) % 3}, path)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cache = os.path.join(tempfile.gettempdir(), f"heldout-corpus-{os.getppid()}.pt")
    if rank == 0:
        prepare_corpus(cache)
    dist.barrier()
    blob = torch.load(cache)
    data = TensorDataset(blob["tokens"].float() / 100, blob["labels"])
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    dist.barrier()
    if rank == 0:
        os.remove(cache)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
