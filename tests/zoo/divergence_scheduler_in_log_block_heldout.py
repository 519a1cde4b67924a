"""LR scheduler stepped inside the rank-0 logging block (silent divergence).

The training loop has a `if is_main_process(): ...` block that logs the
loss and the current learning rate.  When adding warmup the user put
`scheduler.step()` inside that block, next to the lr logging.  Rank 0's
learning rate follows the warmup+decay schedule; rank 1's stays at the
warmup's first value (1% of the base lr) forever.  DDP averages the
gradients, so both ranks get identical gradients, but they apply them with
different learning rates (and Adam's update is then scaled differently), so
the replicas' weights drift apart from the first step on.  No error, no hang.
The script checks at the end and prints the max weight difference.

Root cause: no single rank is "wrong" by itself: the ranks differ because
the scheduler only steps on rank 0.
Right diagnosis: model replicas / parameters diverge across ranks
(different learning rate on rank 1 vs rank 0).
Fix: call scheduler.step() on every rank (outside the rank-0 block).
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": ["scheduler", "learning rate", "every rank", "all ranks", "each rank", "same lr"],
    "options": [],
}


def is_main_process():
    return dist.get_rank() == 0


def warmup_then_linear(total, warmup):
    def f(step):
        if step < warmup:
            return 0.01 + 0.99 * step / warmup
        return max(0.0, (total - step) / (total - warmup))
    return f


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(24, 64)
        self.norm = nn.LayerNorm(64)
        self.mlp = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 24))

    def forward(self, x):
        return self.mlp(self.norm(self.proj(x)))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Encoder())
    total_steps = 60
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_linear(total_steps, 10))
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(total_steps):
        x = torch.randn(32, 24, generator=g)
        noisy = x + 0.3 * torch.randn_like(x)
        loss = nn.functional.mse_loss(model(noisy), x)   # denoising objective
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if is_main_process():
            scheduler.step()
            if step % 10 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}",
                      flush=True)
    # sanity: compare replicas
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    other = flat.clone()
    dist.broadcast(other, src=0)
    print(f"rank {rank}: max |w - w_rank0| = {(flat - other).abs().max().item():.3e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
