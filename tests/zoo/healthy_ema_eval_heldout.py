"""HEALTHY: an EMA copy of the model, updated identically on every rank; rank 0 evaluates it.

Story: the trainer keeps `ModelEMA`, a deep copy of the unwrapped model that is updated
after every optimizer step with decay 0.99 (with the usual "warm-up" of the decay by
step count).  Every rank updates its EMA from its own replica of the DDP model, and those
replicas are identical after each all-reduced step, so the EMA copies are identical too
(checksums printed at the end).  Every 20 steps rank 0 alone evaluates the EMA model on a
small held-out set under torch.no_grad -- the EMA model is a plain nn.Module, not DDP,
so this issues no collective and rank 1 simply runs ahead into the next step's
all-reduce for a few milliseconds.  Exits 0.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None


class ModelEMA:
    def __init__(self, model, decay=0.99):
        self.ema = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay = decay
        self.updates = 0

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for e, p in zip(self.ema.parameters(), model.parameters()):
            e.mul_(d).add_(p.detach(), alpha=1 - d)


def build():
    return nn.Sequential(nn.Linear(24, 96), nn.LayerNorm(96), nn.GELU(), nn.Dropout(0.1), nn.Linear(96, 6))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(build())
    ema = ModelEMA(model.module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(rank)
    proto = torch.randn(6, 24, generator=torch.Generator().manual_seed(3))
    val_y = torch.arange(200) % 6
    val_x = proto[val_y] + 0.8 * torch.randn(200, 24, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(rank)  # per-rank dropout masks
    for step in range(1, 61):
        y = torch.randint(0, 6, (32,), generator=g)
        x = proto[y] + 0.8 * torch.randn(32, 24, generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update(model.module)
        if rank == 0 and step % 20 == 0:
            with torch.no_grad():
                acc = (ema.ema(val_x).argmax(-1) == val_y).float().mean().item()
            print(f"step {step} loss {loss.item():.3f} ema acc {acc:.3f}", flush=True)
    cs = sum(p.double().sum().item() for p in ema.ema.parameters())
    print(f"rank {rank} ema checksum {cs:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
