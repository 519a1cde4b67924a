"""Healthy: rank 0 saves one tiny checkpoint half-way through a short run, then all ranks
meet at a barrier.

Story: a 10-32-32-2 MLP binary classifier, batch 12, 100 steps of ~1 ms.  At step 50 rank 0
writes `{"model", "opt", "step"}` with `torch.save` to a temporary directory (a few
milliseconds, once), and every rank calls `dist.barrier()` right after so nobody races ahead
while the file is written.  Rank 1 waits for rank 0 once, for a few ms; on every other step
the ranks do the same work.  A one-off pause is not a straggler.

Right diagnosis: nothing to report (no warning, no error).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)

EXPECT = None

STEPS = 100
SAVE_AT = 50


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                              nn.Linear(32, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    ckpt_dir = tempfile.mkdtemp(prefix="ckpt_") if rank == 0 else None
    g = torch.Generator().manual_seed(rank)
    w_true = torch.randn(10, generator=torch.Generator().manual_seed(1))
    for step in range(1, STEPS + 1):
        x = torch.randn(12, 10, generator=g)
        y = (x @ w_true > 0).long()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == SAVE_AT:
            if rank == 0:
                path = os.path.join(ckpt_dir, f"step{step}.pt")
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "step": step}, path)
                print(f"saved {path} loss {loss.item():.4f}", flush=True)
            dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
