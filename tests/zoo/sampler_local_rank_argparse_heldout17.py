"""Keyword-spotting trainer ported from torch.distributed.launch to torchrun: the sampler's rank
still comes from `--local_rank`, which torchrun never passes, so every rank is rank 0 to it.

Story: a small CNN on 40x32 MFCC patches, 12 keywords.  The script was written for the old
`python -m torch.distributed.launch`, which appended `--local_rank=N` to each process's
arguments; the argparse option (default 0) stayed when the job moved to torchrun, which sets
the LOCAL_RANK environment variable instead.  `DistributedSampler(..., rank=args.local_rank)`
therefore builds the rank-0 shard on both processes: both ranks read exactly the same
batches in the same order every epoch (set_epoch is called, so the order changes per epoch,
identically on both), half the dataset is never seen, and the "global batch" is one batch
twice.  Nothing fails; the loss curve looks normal.

Root cause: the sampler made with the wrong rank (no single rank at fault).
Right diagnosis: missing_distributed_sampler (ranks train on the same data), at the sampler.
Fix: DistributedSampler's rank from dist.get_rank() (or leave rank unset / read LOCAL_RANK).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": "missing_distributed_sampler",
    "rank": None,
    "fix": ["rank", "local_rank", "LOCAL_RANK", "get_rank", "DistributedSampler"],
    "options": [],
}

KEYWORDS = 12


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args()


def make_mfcc_set(n, seed):
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(KEYWORDS, 1, 40, 32, generator=g)
    labels = torch.randint(0, KEYWORDS, (n,), generator=g)
    shift = torch.randint(-3, 4, (n,), generator=g)
    x = templates[labels] + 1.5 * torch.randn(n, 1, 40, 32, generator=g)
    x = torch.stack([torch.roll(x[i], int(shift[i]), dims=-1) for i in range(n)])
    return TensorDataset(x, labels)


class KwsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * 10 * 8, KEYWORDS)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_mfcc_set(2000, seed=11)
    sampler = DistributedSampler(data, num_replicas=world, rank=args.local_rank, shuffle=True)  # zoo: place
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = DDP(KwsNet())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        correct = seen = 0
        for x, y in loader:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct += (logits.argmax(1) == y).sum().item()
            seen += len(y)
        print(f"rank {rank} epoch {epoch} train acc {correct / seen:.3f} "
              f"({seen} samples)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
