"""Uneven shards and no barrier at the end: rank 0 runs out of data and exits; rank 1's next
gradient all-reduce fails with a closed connection."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": "uneven_inputs", "rank": 0, "fix": "join", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    xs, ys = torch.randn(100, 16), torch.randint(0, 4, (100,))
    mine = list(range(rank * 40, 40 + rank * 60))  # 40 samples on rank 0, 60 on rank 1
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(0, len(mine), 8):
        idx = mine[i : i + 8]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xs[idx]), ys[idx])  # zoo: place
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
