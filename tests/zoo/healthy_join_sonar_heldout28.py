"""Passive-sonar vessel classification (cargo / tanker / tug / passenger / background)
from hydrophone spectrogram patches, trained with DDP (gloo, CPU).

What the job does
    Rank 0 exports one .pt file per hydrophone deployment (deployments recorded for
    different lengths, so the files hold different numbers of 64x32 spectrogram
    patches) under $TMPDIR/ddpdoctor-zoo/sonar_vessels/, then all ranks meet at a
    barrier.  Each rank trains on its own deployments, files[rank::world_size]
    (rank 0 ends up with more batches than rank 1), with a small CNN and plain SGD.
    Every epoch runs inside `with Join([model]):`; after it the epoch metrics are
    all-reduced on every rank, rank 0 saves model.module.state_dict() and all ranks
    meet at a barrier.

Healthy: why it is correct
    The inputs are uneven on purpose and DDP's Join context handles it: the rank that
    runs out of batches shadows the remaining gradient all-reduces (contributing zeros)
    until every rank is done, and on exit the last joiner broadcasts the final weights,
    so the replicas are identical after each epoch.  The optimizer is stateless SGD (no
    momentum), so the rank that took fewer steps keeps no stale optimizer state.
    All collectives outside the Join block (metrics all_reduce, barriers) are reached
    by every rank; checkpointing is rank-0-only with a barrier everyone reaches.

Fix
    None needed.

Observed (plain run: OMP_NUM_THREADS=1 timeout 90 torchrun --standalone --nproc_per_node 2)
    Exit code 0 in ~8-11 s (4 runs), no warnings.  "rank 0: 1150 patches, 36
    batches/epoch", "rank 1: 770 patches, 25 batches/epoch", then
    "epoch 0: loss 1.6016 acc 0.248", "epoch 1: loss 1.5283 acc 0.278",
    "epoch 2: loss 1.1550 acc 0.653".  An instrumented run that all-gathered the
    parameters at the end found them identical on both ranks (max diff 0).
"""
import gc
import glob
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

EXPECT = None

SEED = 9001
DATA_DIR = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "sonar_vessels")
CLASSES = ("cargo", "tanker", "tug", "passenger", "background")
# patches per deployment (hydrophones were recovered after different durations)
DEPLOYMENTS = {"HY01": 420, "HY02": 260, "HY03": 380, "HY04": 300, "HY05": 350, "HY06": 210}
N_FREQ, N_TIME = 64, 32
BATCH = 32
EPOCHS = 3
LR = 0.05


def synth_patches(n, g):
    labels = torch.randint(0, len(CLASSES), (n,), generator=g)
    f = torch.arange(N_FREQ, dtype=torch.float32)[:, None]
    t = torch.arange(N_TIME, dtype=torch.float32)[None, :]
    x = 0.5 * torch.randn(n, N_FREQ, N_TIME, generator=g)
    for i in range(n):
        c = int(labels[i])
        if c == len(CLASSES) - 1:
            continue
        blade_rate = 4 + 5 * c + float(torch.rand(1, generator=g))       # tonal line (bins)
        for harmonic in (1, 2, 3):
            x[i] += 1.5 / harmonic * torch.exp(-((f - harmonic * blade_rate) / 0.8) ** 2)
        x[i] += 0.4 * (1 + torch.cos(2 * math.pi * t * (c + 1) / N_TIME)) * (f < 10)  # cavitation modulation
    return x[:, None], labels


def export_deployments():
    os.makedirs(DATA_DIR, exist_ok=True)
    g = torch.Generator().manual_seed(SEED)
    for name, n in DEPLOYMENTS.items():
        x, y = synth_patches(n, g)
        torch.save({"spectrogram": x, "label": y}, os.path.join(DATA_DIR, f"{name}.pt"))


def load_deployments(paths):
    parts = []
    for p in paths:
        blob = torch.load(p)
        parts.append(TensorDataset(blob["spectrogram"], blob["label"]))
    return ConcatDataset(parts)


class SonarCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        )
        self.fc = nn.Linear(32, len(CLASSES))

    def forward(self, x):
        return self.fc(self.conv(x).amax(dim=(2, 3)))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)

    if rank == 0:
        export_deployments()
    dist.barrier()

    files = sorted(glob.glob(os.path.join(DATA_DIR, "HY*.pt")))
    ds = load_deployments(files[rank::world])
    g = torch.Generator().manual_seed(SEED + rank)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, generator=g)
    print(f"rank {rank}: {len(ds)} patches, {len(loader)} batches/epoch", flush=True)

    model = DDP(SonarCNN())
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    for epoch in range(EPOCHS):
        loss_sum, correct, seen = 0.0, 0, 0
        with Join([model]):
            for x, y in loader:
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_sum += loss.item() * len(y)
                correct += (logits.argmax(1) == y).sum().item()
                seen += len(y)
        stats = torch.tensor([loss_sum, correct, seen], dtype=torch.float64)
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch}: loss {stats[0] / stats[2]:.4f} acc {stats[1] / stats[2]:.3f}", flush=True)
            torch.save(model.module.state_dict(), os.path.join(DATA_DIR, "sonar_cnn.pt"))
        dist.barrier()

    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
