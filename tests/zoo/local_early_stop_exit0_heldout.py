"""Early stopping done wrong: after every 5 steps each rank looks at its OWN running loss and,
if it is below a target, logs 'target reached' and calls sys.exit(0). Rank 0's shard happens to
be the easy half of the data (its labels are a clean function of the features), so rank 0
reaches the target at step 15 and exits with status 0 -- a 'successful' exit, no traceback.
Rank 1's loss is still high; it keeps training and is left in a gradient all-reduce with a
peer that is gone. The job breaks although no process ever failed first: the root is rank 0."""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {"kind": None, "rank": 0, "fix": ["every rank", "all_reduce", "agree", "stop"], "names": ["exit"], "options": []}

TARGET = 0.6


def make_shard(rank: int) -> TensorDataset:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(480, 10, generator=g)
    # rank 0: one feature decides (easy); rank 1: noisy labels, its loss stays near ln 2
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
            print(f"rank {rank} step {step} avg loss {avg:.3f}", flush=True)
            if avg < TARGET:
                print(f"rank {rank}: target reached, stopping", flush=True)
                sys.exit(0)  # zoo: place
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
