"""Rank 1 re-validates its data shard at the start of epoch 1 (a paranoid 'labels must be in
range' check run per shard). Its shard holds out-of-range labels that only the check notices:
it prints a one-line error to stderr and calls sys.exit(2) -- no traceback. Rank 0 has already
started epoch 1 and sits in DDP's gradient all-reduce waiting for a peer that is gone.
The root is rank 1, which left with exit status 2."""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": None, "rank": 1, "fix": ["shard", "label", "exit"], "names": [["code 2", "status 2"], "shard check failed"], "options": []}

NUM_CLASSES = 4


def validate_shard(labels: torch.Tensor, rank: int, epoch: int) -> None:
    bad = int(((labels < 0) | (labels >= NUM_CLASSES)).sum())
    if bad:
        print(f"[rank {rank}] shard check failed at epoch {epoch}: {bad} labels outside [0, {NUM_CLASSES})",
              file=sys.stderr, flush=True)
        sys.exit(2)  # zoo: place


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(160, 16)
    y = torch.randint(0, NUM_CLASSES, (160,))
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, NUM_CLASSES)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        shard_labels = y[list(iter(sampler))]
        if epoch == 1 and rank == 1:
            shard_labels = shard_labels.clone()
            shard_labels[::17] = NUM_CLASSES + 3   # the "relabelled" rows only rank 1 holds
        validate_shard(shard_labels, rank, epoch)
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} done", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
