"""Healthy twin: rank-seeded init, per-rank augmentation, and a head reset after wrapping, all safe.

Story: a handwriting-stroke classifier (pen trajectories of 6 glyphs) with a two-stage recipe
like its divergent sibling, written by someone who knew where DDP syncs.  Each rank seeds its
RNG with its rank at the top of the script, so the freshly built model differs per rank, but
it is built *before* DDP, whose constructor broadcasts rank 0's parameters to all.  The
augmentation (random scale, shift and dropout of pen points) draws from a per-rank
`torch.Generator`, so every rank sees differently augmented strokes, as intended.  For stage 2
the head is re-initialised through `model.module` after wrapping, which would diverge, except
that `reset_head()` does it inside `torch.random.fork_rng()` under one fixed seed, the same
on every rank, and the stage-2 optimizer is rebuilt on every rank.  The replicas stay
identical to the bit.

Root cause: none (healthy).
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)

EXPECT = None

GLYPHS = 6
POINTS = 32


def strokes(n, gen):
    label = torch.randint(0, GLYPHS, (n,), generator=gen)
    t = torch.linspace(0, 2 * math.pi, POINTS)
    k = label[:, None].float() + 1
    xy = torch.stack([torch.cos(k * t) * (1 + 0.1 * k), torch.sin((k % 3 + 1) * t)], -1)
    return xy + 0.05 * torch.randn(xy.shape, generator=gen), label


class Augment:
    def __init__(self, gen):
        self.gen = gen

    def __call__(self, xy):
        n = xy.shape[0]
        scale = 1 + 0.2 * (torch.rand(n, 1, 1, generator=self.gen) - 0.5)
        shift = 0.1 * torch.randn(n, 1, 2, generator=self.gen)
        keep = (torch.rand(n, POINTS, 1, generator=self.gen) > 0.1).float()
        return (xy * scale + shift) * keep


class StrokeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(2, 32, 5, padding=2), nn.ReLU(),
                                  nn.Conv1d(32, 32, 5, padding=2), nn.ReLU())
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(32, GLYPHS)

    def forward(self, xy):
        h = self.conv(xy.transpose(1, 2)).mean(-1)
        return self.head(self.drop(h))


def reset_head(net, seed=1234):
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # same draw on every rank
        net.head.reset_parameters()


def run_stage(model, opt, data_gen, augment, epochs, noisy_labels=False):
    for _ in range(epochs):
        xy, y = strokes(384, data_gen)
        if noisy_labels:  # stage 1 learns from a weaker, machine-labelled set
            flip = torch.rand(len(y), generator=data_gen) < 0.3
            y = torch.where(flip, torch.randint(0, GLYPHS, y.shape, generator=data_gen), y)
        for i in range(0, len(y), 48):
            loss = F.cross_entropy(model(augment(xy[i:i + 48])), y[i:i + 48])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return loss.item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)  # dropout masks differ per rank; the init is overwritten by DDP
    net = StrokeNet()
    model = DDP(net)
    augment = Augment(torch.Generator().manual_seed(500 + rank))
    data_gen = torch.Generator().manual_seed(40 + rank)

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss = run_stage(model, opt, data_gen, augment, epochs=4, noisy_labels=True)
    if rank == 0:
        print(f"stage 1 done: loss {loss:.3f}", flush=True)

    reset_head(model.module)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    loss = run_stage(model, opt, data_gen, augment, epochs=6)
    if rank == 0:
        print(f"stage 2 done: loss {loss:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
