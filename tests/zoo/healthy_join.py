"""Healthy twin of uneven_hang: the same unequal shards, under model.join()."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    n = 48 + 24 * rank
    xs, ys = torch.randn(n, 16), torch.randint(0, 4, (n,))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with model.join():
        for i in range(0, n, 8):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xs[i : i + 8]), ys[i : i + 8]).backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
