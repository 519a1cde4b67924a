"""Each rank slices the data itself, without DistributedSampler's padding: rank 1 gets three
more batches, runs a gradient all-reduce rank 0 never joins, while rank 0 waits in barrier()."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": "uneven_inputs", "rank": 0, "fix": "join", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    n = 48 + 24 * rank  # a filtered dataset: the shards are not equal
    xs, ys = torch.randn(n, 16), torch.randint(0, 4, (n,))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(0, n, 8):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xs[i : i + 8]), ys[i : i + 8])  # zoo: place
        loss.backward()
        opt.step()
    dist.barrier()  # zoo: place
    if os.environ.get("RANK") == "0":
        print("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
