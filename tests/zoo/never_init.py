"""Rank 1 fails reading its config before init_process_group and exits 3: it never becomes a
rank, and rank 0 waits at the rendezvous until torchrun stops it."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": "rank_never_started", "rank": 1, "fix": "init_process_group", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def main() -> None:
    if os.environ.get("RANK") == "1" and not os.path.exists("/nonexistent/config.yaml"):
        print("config not found", file=sys.stderr)
        sys.exit(3)
    dist.init_process_group("gloo")
    model = DDP(nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
