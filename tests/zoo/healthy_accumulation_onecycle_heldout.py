"""HEALTHY: gradient accumulation with no_sync, clipping, OneCycle and all-rank logging.

Each optimizer step accumulates 4 micro-batches; the first 3 backward passes
run inside `model.no_sync()` (no gradient all_reduce), the 4th synchronises.
Gradients are clipped, a OneCycleLR scheduler steps on every rank after each
optimizer step, and every 5 optimizer steps all ranks all_reduce the running
loss in `MetricLogger.sync()` (only rank 0 prints).  Skipping the all_reduce
on 3 of 4 backwards looks like "a rank skips a collective" but is the intended
no_sync pattern, identical on every rank.  Exits 0.

Expected: no warning, no error.
"""
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None

ACCUM = 4
OPT_STEPS = 40


class MetricLogger:
    def __init__(self):
        self.sum = 0.0
        self.n = 0

    def update(self, v):
        self.sum += v
        self.n += 1

    def sync(self):
        t = torch.tensor([self.sum, float(self.n)], dtype=torch.float64)
        dist.all_reduce(t)
        self.sum, self.n = 0.0, 0
        return (t[0] / t[1]).item()


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.ff(self.ln(x))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 32), Block(32), Block(32), nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=OPT_STEPS)
    logger = MetricLogger()
    g = torch.Generator().manual_seed(rank + 7)
    for step in range(OPT_STEPS):
        opt.zero_grad(set_to_none=True)
        for micro in range(ACCUM):
            x = torch.randn(16, 8, generator=g)
            y = x.pow(2).sum(1, keepdim=True)
            ctx = model.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext()
            with ctx:
                loss = nn.functional.mse_loss(model(x), y) / ACCUM
                loss.backward()
            logger.update(loss.item() * ACCUM)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 5 == 4:
            avg = logger.sync()
            if rank == 0:
                print(f"opt step {step} loss {avg:.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
