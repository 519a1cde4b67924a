"""Gradient-accumulation spike guard that syncs the norm only when it is large -> hang.

Story: a tabular regression job accumulates gradients over 4 micro-batches, using
`model.no_sync()` for the first 3.  After every micro-batch a `SpikeGuard` helper looks at
the (local, not yet all-reduced) gradient norm; when it exceeds `max_norm` it all-gathers
every rank's norm and takes the max "so that every rank clips by the same factor" and rescales the gradient.
The author assumed spikes are global.  Rank 1's shard contains a batch of corrupt
targets (values x1000) that arrives inside a no_sync micro-step, so only rank 1 enters the
`dist.all_gather` in `SpikeGuard.__call__`; rank 0 finishes its micro-batches and waits
in DDP's gradient all-reduce in the synchronised backward.  Neither collective can complete.

Root cause: rank 1 (it issued an extra all_gather that rank 0 never calls).
Right diagnosis: a hang caused by a collective issued under a rank-local condition
(SpikeGuard's all_gather on rank 1 vs. rank 0 in DDP's backward all-reduce).
Fix: make the collective unconditional (always gather/all_reduce the norm, then decide), or
clip only after the synchronised micro-step, e.g. with clip_grad_norm_.
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
        "unconditional",
        "every rank",
        "all ranks",
        "always",
        "clip_grad_norm",
        "condition",
        "same collective",
        "each rank",
    ],
    "names": [["SpikeGuard", "__call__"]],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


class Regressor(nn.Module):
    def __init__(self, n_in=16):
        super().__init__()
        # dataset statistics, fixed at construction (same on every rank)
        self.register_buffer("feat_mean", torch.linspace(-1, 1, n_in))
        self.register_buffer("feat_std", torch.linspace(0.5, 2, n_in))
        self.net = nn.Sequential(nn.Linear(n_in, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.net((x - self.feat_mean) / self.feat_std).squeeze(-1)


class SpikeGuard:
    def __init__(self, params, max_norm=50.0):
        self.params = [p for p in params if p.requires_grad]
        self.max_norm = max_norm
        self.clipped = 0

    def __call__(self):
        norm = torch.norm(torch.stack([p.grad.detach().norm() for p in self.params]))
        if norm > self.max_norm:
            # collect every rank's norm (also handy for the spike log) and clip by the worst
            norms = [torch.zeros_like(norm) for _ in range(dist.get_world_size())]
            dist.all_gather(norms, norm)  # zoo: place
            norm = torch.stack(norms).max()
            for p in self.params:
                p.grad.mul_(self.max_norm / (norm + 1e-6))
            self.clipped += 1
        return norm


def shard(rank, steps, accum, bs):
    g = torch.Generator().manual_seed(10 + rank)
    w = torch.randn(16, generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        for micro in range(accum):
            x = torch.randn(bs, 16, generator=g)
            y = x @ w + 0.1 * torch.randn(bs, generator=g)
            if rank == 1 and step == 6 and micro == 1:
                y = y * 1000.0  # corrupt rows from an upstream unit bug
            yield step, micro, x, y


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Regressor())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SpikeGuard(model.parameters())
    accum = 4

    for step, micro, x, y in shard(rank, steps=40, accum=accum, bs=32):
        last = micro == accum - 1
        if last:
            loss = F.mse_loss(model(x), y) / accum
            loss.backward()
        else:
            with model.no_sync():
                loss = F.mse_loss(model(x), y) / accum
                loss.backward()
        guard()
        if last:
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rank == 0 and step % 5 == 0:
                print(f"step {step} loss {loss.item() * accum:.4f}", flush=True)

    print(f"rank {rank} done, clipped {guard.clipped}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
