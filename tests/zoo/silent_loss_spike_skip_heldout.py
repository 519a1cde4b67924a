"""Rank-local "skip the step on a loss spike" guard -> replicas silently diverge.

Story: to survive occasional bad batches the user added `LossSpikeGuard`: it keeps an
exponential moving average of the loss and, when the current loss exceeds 2.5x that
average, skips `optimizer.step()` for this batch.  The check uses the *local* loss
(`loss.item()` on this rank).  DDP's backward has already all-reduced the gradients on
both ranks, so every collective still matches and nothing hangs -- but rank 1's shard
has a few very hard batches, so rank 1 skips steps that rank 0 takes.  From the first
skip on, the replicas hold different weights (and different Adam state) and keep
drifting apart; the job finishes with exit code 0.

Root cause: rank 1 (it skipped optimizer steps that rank 0 took).
Right diagnosis: silent divergence of model parameters across ranks caused by a
rank-local decision to skip the optimizer step.
Fix: make the skip decision collectively: all_reduce the loss (or a skip flag) so every
rank takes the same decision, or decide from the all-reduced gradient norm.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": [
        "all_reduce",
        "allreduce",
        "all-reduce",
        "broadcast",
        "every rank",
        "all ranks",
        "same decision",
        "global loss",
        "collective",
        "skip",
    ],
    "options": [],
}


class LossSpikeGuard:
    def __init__(self, factor=2.5, beta=0.9, warmup=5):
        self.factor, self.beta, self.warmup = factor, beta, warmup
        self.avg = None
        self.seen = 0
        self.skipped = 0

    def ok(self, loss_value):
        self.seen += 1
        if self.avg is not None and self.seen > self.warmup and loss_value > self.factor * self.avg:
            self.skipped += 1
            return False
        self.avg = loss_value if self.avg is None else self.beta * self.avg + (1 - self.beta) * loss_value
        return True


def make_batch(rank, step, g, w):
    x = torch.randn(64, 20, generator=g)
    y = x @ w
    if rank == 1 and step % 9 == 4:
        y = y + 8.0 * torch.randn(64, 1, generator=g)  # hard/noisy batches from one source
    return x, y


def checksum(module):
    return sum(p.detach().double().sum().item() for p in module.parameters())


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(20, 64), nn.SiLU(), nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    guard = LossSpikeGuard()
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(20, 1, generator=torch.Generator().manual_seed(123))
    for step in range(60):
        x, y = make_batch(rank, step, g, w)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if guard.ok(loss.item()):
            opt.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    print(
        f"rank {rank} skipped {guard.skipped} steps, weight checksum {checksum(model.module):.6f}", flush=True
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
