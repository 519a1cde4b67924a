"""HEALTHY: activation checkpointing + a custom autograd Function inside DDP.

Story: a small residual MLP "memory-saving" model.  Each residual block runs through
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` (the non-reentrant variant,
which is the one that composes with DDP), and the block's activation is a custom
`torch.autograd.Function` (`ClampSTE`: hard clamp in forward, straight-through gradient
in backward, saving its input with ctx.save_for_backward).  Recomputation in backward
re-runs the custom Function on every rank the same way; all parameters get gradients
every step, so find_unused_parameters=False is right.  Gradients are clipped with
clip_grad_norm_ after backward (grads are already all-reduced, so every rank clips by the
same factor).  Replicas stay identical (checksums printed).  Exits 0.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

EXPECT = None


class ClampSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bound):
        ctx.save_for_backward(x)
        ctx.bound = bound
        return x.clamp(-bound, bound)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        # straight-through, but damp gradients far outside the range
        scale = torch.where(x.abs() > 4 * ctx.bound, 0.1, 1.0)
        return grad_out * scale, None


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(ClampSTE.apply(self.fc1(self.norm(x)), 2.0))


class Net(nn.Module):
    def __init__(self, dim=64, depth=4):
        super().__init__()
        self.inp = nn.Linear(32, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = checkpoint(blk, h, use_reentrant=False)
        return self.out(h).squeeze(-1)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(32, generator=torch.Generator().manual_seed(7))
    for step in range(60):
        x = torch.randn(64, 32, generator=g)
        y = torch.sin(x @ w)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    cs = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"rank {rank} checksum {cs:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
