"""Each rank builds its head from its own config (rank 1 reads a stale file that says 8
classes, rank 0 says 4): DDP's constructor finds the parameters' shapes differ and raises. The
diagnosis sets the two shapes side by side and names the module that differs."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": "model_differs", "rank": None, "fix": "same", "options": []}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    num_classes = 4 if rank == 0 else 8
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, num_classes))
    model = DDP(model)  # zoo: place
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
