"""A 'loss is NaN' guard, evaluated on each rank's own local loss before backward. Rank 0's
shard holds a corrupt sample (a NaN feature from a bad preprocessing run); when that batch comes
up at step 7, rank 0 prints a warning and does `raise SystemExit(1)` -- which Python turns into
a silent exit with status 1, no traceback. Rank 1 has a finite loss, runs backward, and waits in
the gradient all-reduce. The root is rank 0 (exit status 1)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {"kind": None, "rank": 0, "fix": ["nan", "every rank", "all_reduce"], "names": [["code 1", "status 1"]], "options": []}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(240, 12)
    y = x[:, :3].sum(dim=1, keepdim=True) + 0.1 * torch.randn(240, 1)
    # contiguous shards, as a pre-sharded dataset would give; row 56 sits in rank 0's shard
    x[56, 5] = float("nan")
    per = len(x) // world
    shard = TensorDataset(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
    loader = DataLoader(shard, batch_size=8, shuffle=False)
    model = DDP(nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        if not torch.isfinite(loss):
            print(f"rank {rank}: loss is {loss.item()} at step {step}, aborting", flush=True)
            raise SystemExit(1)  # zoo: place
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
