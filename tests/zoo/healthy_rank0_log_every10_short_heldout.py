"""Healthy: rank 0 prints a progress line every 10 steps; steps are ~1 ms.

Story: a small 2-layer ReLU MLP (20-48-48-5) on synthetic blobs, batches of 8 drawn from a
per-rank seeded generator (no loader), 120 steps with a StepLR schedule.  Only rank 0 prints
`step / loss / lr` every 10th step -- the usual `if rank == 0 and step % 10 == 0` pattern.  The
print costs rank 0 a few tens of microseconds once every 10 steps; that is not a persistent
imbalance, and no rank does more work than the other on the other steps.

Right diagnosis: nothing to report (no warning, no error).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)

EXPECT = None

STEPS = 120
LOG_EVERY = 10


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(),
                              nn.Linear(48, 5)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)
    g = torch.Generator().manual_seed(100 + rank)
    protos = torch.randn(5, 20, generator=torch.Generator().manual_seed(7))
    for step in range(STEPS):
        y = torch.randint(0, 5, (8,), generator=g)
        x = protos[y] + 0.5 * torch.randn(8, 20, generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0 and step % LOG_EVERY == 0:
            lr = sched.get_last_lr()[0]
            print(f"step {step:4d} loss {loss.item():.4f} lr {lr:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
