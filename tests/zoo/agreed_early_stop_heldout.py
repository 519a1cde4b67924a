"""Healthy twin of local early stopping: every 5 steps each rank computes its own running loss,
but the decision is agreed -- the ranks all_reduce(MAX) a 0/1 'stop' flag, so as soon as any
rank reaches the target all ranks break out of the loop at the same step, meet at a barrier,
destroy the process group and sys.exit(0) together. Rank 0 (easy shard) triggers the stop
around step 15, long before the epoch ends. Nothing is wrong."""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = None

TARGET = 0.6


def make_shard(rank: int) -> TensorDataset:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(480, 10, generator=g)
    y = (x[:, 0] > 0).long() if rank == 0 else torch.randint(0, 2, (480,), generator=g)
    return TensorDataset(x, y)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    loader = DataLoader(make_shard(rank), batch_size=16, shuffle=True)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    running = 0.0
    for step, (x, y) in enumerate(loader, start=1):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        running += loss.item()
        if step % 5 == 0:
            avg, running = running / 5, 0.0
            stop = torch.tensor(1.0 if avg < TARGET else 0.0)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() > 0:
                print(f"rank {rank}: stopping at step {step} (agreed), local avg loss {avg:.3f}", flush=True)
                break
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
