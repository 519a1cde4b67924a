"""Stage 2 re-initialises the classifier on the wrapped model, after per-rank seeding -> divergence.

Story: a two-stage recipe for a small gesture recogniser on accelerometer traces.  Stage 1
trains the whole network on a pretext task (predict which of 8 rotations was applied to the
trace); stage 2 keeps the encoder and fine-tunes on the 5 gesture labels.  The model is built
with one seed on every rank and wrapped in DDP once, before stage 1.  Right after wrapping
the script seeds each rank differently (`torch.manual_seed(1000 + rank)`) so that the random
rotations and jitter differ per rank, which is correct for augmentation.  But when stage 2
starts, `GestureNet.start_finetune()` calls `reset_parameters()` on the head through
`model.module`: the head's new values are drawn from each rank's own RNG stream, after DDP's
one-time broadcast.  Gradients are still averaged, so every step applies the same update to
two different heads, and the replicas never agree again.  No error, no warning; only rank 0
saves the checkpoint, so the difference is never seen.

Root cause: no single rank; the head (`head.weight`, `head.bias`) is re-initialised after
wrapping with a rank-dependent RNG state.
Fix: reset the head before wrapping in DDP (or with the same seed on every rank), or
broadcast its parameters from rank 0 after the reset.
"""

import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)

EXPECT = {
    "kind": ["weights_diverged"],
    "rank": None,
    "fix": ["before wrapping", "before DDP", "before the DDP", "broadcast", "same seed", "seed",
            "every rank", "all ranks", "reset_parameters"],
    "names": [["head", "start_finetune", "reset_parameters"]],
    "options": [],
}

GESTURES = 5
ROTATIONS = 8


class GestureNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.GRU(3, 48, batch_first=True)
        self.proj = nn.Linear(48, 48)
        # one 8-way head serves both stages, so DDP's buckets never change
        self.head = nn.Linear(48, ROTATIONS)

    def forward(self, trace):
        _, h = self.encoder(trace)
        return self.head(torch.tanh(self.proj(h[-1])))

    def start_finetune(self):
        """Fresh classifier for the downstream task (its first GESTURES logits are used)."""
        self.head.reset_parameters()  # zoo: place


def gesture_traces(n, rank, epoch):
    g = torch.Generator().manual_seed(97 * rank + epoch)
    labels = torch.randint(0, GESTURES, (n,), generator=g)
    t = torch.linspace(0, 1, 40)
    freq = 1.0 + labels[:, None].float()
    trace = torch.stack([torch.sin(2 * math.pi * freq * t), torch.cos(2 * math.pi * freq * t),
                         0.5 * torch.sin(math.pi * freq * t)], dim=-1)
    return trace + 0.1 * torch.randn(trace.shape, generator=g), labels


def rotate(trace):
    """Random rotation about z, drawn from the (per-rank) global RNG: the pretext label."""
    k = torch.randint(0, ROTATIONS, (trace.shape[0],))
    a = k.float() * (2 * math.pi / ROTATIONS)
    c, s = torch.cos(a)[:, None], torch.sin(a)[:, None]
    x, y, z = trace.unbind(-1)
    return torch.stack([c * x - s * y, s * x + c * y, z], dim=-1), k


def jitter(trace):
    return trace + 0.05 * torch.randn_like(trace)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(GestureNet())
    torch.manual_seed(1000 + rank)  # different augmentation on each rank
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    # stage 1: pretext, predict the rotation
    for epoch in range(3):
        traces, _ = gesture_traces(512, rank, epoch)
        for i in range(0, 512, 64):
            x, k = rotate(traces[i:i + 64])
            loss = F.cross_entropy(model(jitter(x)), k)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"pretext epoch {epoch}: loss {loss.item():.3f}", flush=True)

    # stage 2: fine-tune on gestures with a fresh head
    model.module.start_finetune()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(4):
        traces, labels = gesture_traces(512, rank, 10 + epoch)
        for i in range(0, 512, 64):
            logits = model(jitter(traces[i:i + 64]))[:, :GESTURES]
            loss = F.cross_entropy(logits, labels[i:i + 64])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"finetune epoch {epoch}: loss {loss.item():.3f}", flush=True)

    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(model.module.state_dict(), os.path.join(tmp, "gesture.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
