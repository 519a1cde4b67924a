"""Arrhythmia detection on synthetic single-lead ECG windows.

A 1-D CNN classifies 2-second ECG windows as normal sinus rhythm vs. atrial fibrillation
(irregular R-R intervals, no P waves). Each rank validates on the recordings of its own
hospital site every 10 steps and an EarlyStopping helper decides when to stop. Site B (rank
1) has a small validation split whose labels were produced by a different annotation
protocol, so its validation loss stops improving early.

Root cause: the early-stopping decision is taken from each rank's *local* validation loss,
so rank 1 alone breaks out of the training loop, tears down its process group and exits
cleanly (exit code 0) while rank 0 keeps training and its next gradient all-reduce fails.
Fix: make the stop decision collectively -- all_reduce the validation loss (or the stop flag)
so every rank agrees and stops at the same step.
"""

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": ["rank_left_early", "rank_failure"],
    "rank": 1,
    "fix": [
        "all_reduce",
        "all-reduce",
        "agree",
        "broadcast",
        "global",
        "all ranks",
        "every rank",
        "sync",
        "collective",
        "same step",
        "stop flag",
        "early stop",
        "consensus",
        "reduce",
    ],
    "options": [],
}

FS = 100  # Hz
WIN = 2 * FS


def synth_ecg(n, seed, afib_frac=0.5, label_noise=0.0):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(WIN).float() / FS
    xs, ys = [], []
    for _ in range(n):
        afib = bool(torch.rand(1, generator=g) < afib_frac)
        sig = torch.zeros(WIN)
        beat = float(torch.rand(1, generator=g)) * 0.3
        while beat < 2.0:
            rr = 0.8 + (0.35 * (float(torch.rand(1, generator=g)) - 0.5) * 2 if afib else 0.02)
            sig += torch.exp(-((t - beat) ** 2) / 0.0004)  # R peak
            if not afib:
                sig += 0.15 * torch.exp(-((t - beat + 0.16) ** 2) / 0.002)  # P wave
            sig += 0.3 * torch.exp(-((t - beat - 0.25) ** 2) / 0.004)  # T wave
            beat += rr
        sig += 0.05 * torch.randn(WIN, generator=g)
        label = int(afib)
        if label_noise and float(torch.rand(1, generator=g)) < label_noise:
            label = 1 - label
        xs.append(sig)
        ys.append(label)
    return torch.stack(xs).unsqueeze(1), torch.tensor(ys)


class ECGNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(1, 8, 7, padding=3),
            nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Conv1d(8, 16, 7, padding=3),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(8),
        )
        self.fc = nn.Linear(16 * 8, 2)

    def forward(self, x):
        return self.fc(self.body(x).flatten(1))


class EarlyStopping:
    def __init__(self, patience=2, min_delta=1e-3):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.bad = math.inf, 0

    def step(self, val_loss):
        if val_loss < self.best - self.min_delta:
            self.best, self.bad = val_loss, 0
        else:
            self.bad += 1
        return self.bad >= self.patience


@torch.no_grad()
def validate(model, x, y):
    model.eval()
    loss = F.cross_entropy(model.module(x), y).item()
    model.train()
    return loss


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    xtr, ytr = synth_ecg(640, seed=11 + rank)
    # site B's validation split: relabelled under another protocol (many labels flipped)
    xva, yva = synth_ecg(64, seed=500 + rank, label_noise=0.0 if rank == 0 else 0.45)
    torch.manual_seed(0)
    model = DDP(ECGNet())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    stopper = EarlyStopping(patience=2)
    bs, t0 = 32, time.time()
    for step in range(200):
        i = (step * bs) % len(xtr)
        loss = F.cross_entropy(model(xtr[i : i + bs]), ytr[i : i + bs])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 10 == 0:
            vl = validate(model, xva, yva)
            print(
                f"rank {rank} step {step + 1} train {loss.item():.3f} val {vl:.3f} t={time.time() - t0:.1f}s",
                flush=True,
            )
            if stopper.step(vl):
                print(f"rank {rank}: early stopping at step {step + 1}", flush=True)
                break  # zoo: place
    dist.destroy_process_group()
    print(f"rank {rank} exiting", flush=True)


if __name__ == "__main__":
    main()
