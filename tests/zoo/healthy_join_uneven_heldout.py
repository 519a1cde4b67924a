"""HEALTHY: uneven number of batches per rank, handled correctly with the Join context.

Story: a streaming job reads per-rank files of different sizes (rank 0: 44 batches,
rank 1: 38 batches), so the ranks do NOT run the same number of steps.  The author wraps
the training loop in `torch.distributed.algorithms.join.Join([model])`: when rank 1 runs
out of data it "joins" and shadows the remaining gradient all-reduces of rank 0, and at
the end DDP syncs the final parameters from the last joiner, so both ranks finish with
the same weights (checksums printed).  This is the documented way to train DDP on uneven
inputs; no hang, no error, exits 0.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None


def stream(rank, n_batches, bs=32):
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(10, 3, generator=torch.Generator().manual_seed(9))
    for _ in range(n_batches):
        x = torch.randn(bs, 10, generator=g)
        yield x, (x @ w).argmax(-1)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n_batches = {0: 44, 1: 38}[rank]
    steps = 0
    with Join([model]):
        for x, y in stream(rank, n_batches):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
    cs = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"rank {rank} steps {steps} loss {loss.item():.3f} checksum {cs:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
