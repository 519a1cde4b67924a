"""Rank SLOW (default 1) is slowed by DELAY ms per step in one phase; or, with ``longer``, its
samples are sequences of DELAY rows where the others' are 4 (a sampler that deals the long
sequences to one rank: more work per step, no sleep).

``--own-batches``: the loop cuts its batches from the rank's shard itself, no DataLoader.

Usage: straggler.py {none|data|forward|other|longer} DELAY_MS [--steps N] [--slow RANK] [--own-batches]
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Data(Dataset):
    def __init__(self, n: int, delay_s: float, rows: int = 0) -> None:
        shape = (n, rows, 64) if rows else (n, 64)
        self.x, self.y, self.delay_s = torch.randn(*shape), torch.randint(0, 4, (n,)), delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
        self.delay_s = delay_s

    def forward(self, x):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.body(x) if x.dim() == 2 else self.body(x).mean(dim=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind")
    p.add_argument("delay_ms", type=float)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--slow", type=int, default=1)
    p.add_argument("--own-batches", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    slow = dist.get_rank() == args.slow
    delay = args.delay_ms / 1e3 if slow else 0.0
    batch = 8
    rows = (int(args.delay_ms) if slow else 4) if args.kind == "longer" else 0
    data = Data(batch * args.steps * dist.get_world_size(), delay / batch if args.kind == "data" else 0, rows)
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, seed=0))
    if args.own_batches:  # this rank's contiguous shard, batch by batch
        start = dist.get_rank() * batch * args.steps
        loader = [
            (data.x[i : i + batch], data.y[i : i + batch])
            for i in range(start, start + batch * args.steps, batch)
        ]
    model = DDP(Net(delay if args.kind == "forward" else 0.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if args.kind == "other" and delay:
            time.sleep(delay)  # "logging" between steps on one rank
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
