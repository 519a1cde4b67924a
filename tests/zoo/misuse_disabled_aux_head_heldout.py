"""A deep-supervision head that is built but switched off by config (unused parameters).

`SegNetLite` always constructs an auxiliary classifier `aux_head` on the
intermediate features; `forward()` only evaluates it when
`cfg.aux_loss_weight > 0`.  This run's config sets `aux_loss_weight = 0.0`, so
`aux_head`'s weights never receive a gradient.  The model is wrapped in DDP
with the default find_unused_parameters=False; the first backward leaves the
reducer waiting for `aux_head`'s gradients, and the second iteration's forward
raises "Expected to have finished reduction in the prior iteration ..." on
both ranks.

Root cause: no single rank -- every rank has the same unused parameters.
Right diagnosis: DDP error from parameters that did not receive gradients
(aux_head.*).
Fix: don't construct aux_head when the weight is 0 (or freeze it /
requires_grad_(False)), or pass find_unused_parameters=True.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": ["find_unused_parameters", "unused", "aux_head", "requires_grad"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


@dataclass
class Config:
    width: int = 32
    num_classes: int = 6
    aux_loss_weight: float = 0.0     # deep supervision disabled for this run
    steps: int = 20


class SegNetLite(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.stem = nn.Sequential(nn.Conv1d(4, cfg.width, 3, padding=1), nn.ReLU())
        self.body = nn.Sequential(nn.Conv1d(cfg.width, cfg.width, 3, padding=1), nn.ReLU())
        self.head = nn.Conv1d(cfg.width, cfg.num_classes, 1)
        self.aux_head = nn.Conv1d(cfg.width, cfg.num_classes, 1)

    def forward(self, x):
        mid = self.stem(x)
        out = self.head(self.body(mid))
        aux = self.aux_head(mid) if self.cfg.aux_loss_weight > 0 else None
        return out, aux


def compute_loss(cfg, out, aux, y):
    loss = nn.functional.cross_entropy(out, y)
    if aux is not None:
        loss = loss + cfg.aux_loss_weight * nn.functional.cross_entropy(aux, y)
    return loss


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = Config()
    torch.manual_seed(0)
    model = DDP(SegNetLite(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(cfg.steps):
        x = torch.randn(8, 4, 50, generator=g)
        y = torch.randint(0, cfg.num_classes, (8, 50), generator=g)
        out, aux = model(x)
        loss = compute_loss(cfg, out, aux, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
