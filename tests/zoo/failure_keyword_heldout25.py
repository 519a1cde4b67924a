"""Keyword spotting on field recordings with a small 1-D CNN (2-rank DDP, gloo/CPU).

What the job does
-----------------
A bank of 3200 synthetic "field recordings" (1600 Hz, 1.05-2.0 s each, 8 keywords encoded as
tone pairs buried in noise) is wrapped in a map-style Dataset.  `__getitem__` renders the
clip, takes a random 1-second crop for augmentation, frames it and returns a log-magnitude
spectrogram.  Training uses a DistributedSampler (shuffle, set_epoch every epoch), a
DataLoader and a two-layer Conv1d classifier wrapped in DDP.

Root cause
----------
The random crop assumes every clip is longer than the 1-second crop window:
`torch.randint(0, wav.numel() - CROP, (1,))`.  The recorder app occasionally flushes a clip
early (about 0.1 % of clips end up ~0.6-1.2 s long), so when a rank's sampler hands it a
truncated clip the upper bound becomes <= 0 and `torch.randint` raises a RuntimeError in
that rank's data loading.  The other rank is already inside the step's gradient all-reduce
and is left waiting until the failing process disappears and the launcher tears the job
down.

Fix
---
Pad short clips (e.g. `F.pad(wav, (0, CROP - n))`) or crop with
`max(0, wav.numel() - CROP)` / filter clips by length when building the dataset.

Observed (plain run, torchrun --nproc_per_node 2, OMP_NUM_THREADS=1)
--------------------------------------------------------------------
exit 1 after ~4.5-5 s.  Both ranks log steps 5..40 of epoch 0 (50 steps/epoch, 2 epochs
planned); at step 42 rank 0's sampler hands it a truncated clip (3 of the 3200 clips are
shorter than 1 s) and rank 0 dies in `__getitem__`:
    [rank0]: RuntimeError: random_ expects 'from' to be less than 'to', but got from=0 >= to=-351
Rank 1 is inside loss.backward() (DDP all-reduce) and either gets
"Connection closed by peer" from gloo or is SIGTERMed by torchrun; torchrun reports rank 0
(exitcode 1) as the root-cause failure.  Deterministic (seeded data, sampler and crops).
"""
import logging
import math
import os  # noqa: F401
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = {"kind": ["rank_failure"], "rank": 0, "fix": ["pad", "crop", "randint", "length", "short"], "options": []}

SR = 1600
CROP = SR                     # 1 s random crop
FRAME, HOP = 160, 80
KEYWORDS = ["yes", "no", "up", "down", "left", "right", "stop", "go"]

logger = logging.getLogger("kws")


class FieldRecordings(Dataset):
    def __init__(self, n_clips, seed):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, len(KEYWORDS), (n_clips,), generator=g)
        seconds = 1.05 + 0.95 * torch.rand(n_clips, generator=g)
        flushed_early = torch.rand(n_clips, generator=g) < 0.0012
        seconds = torch.where(flushed_early, seconds * 0.6, seconds)
        self.num_samples = (seconds * SR).long()
        self.clip_seed = torch.randint(0, 2 ** 31 - 1, (n_clips,), generator=g)
        self.window = torch.hann_window(FRAME)

    def __len__(self):
        return len(self.labels)

    def load(self, i):
        g = torch.Generator().manual_seed(int(self.clip_seed[i]))
        n = int(self.num_samples[i])
        t = torch.arange(n, dtype=torch.float32) / SR
        label = int(self.labels[i])
        f0 = 120.0 + 55.0 * label
        onset = 0.05 + max(n / SR - 0.55, 0.0) * float(torch.rand(1, generator=g))
        word = ((t > onset) & (t < onset + 0.45)).float()
        wav = word * (torch.sin(2 * math.pi * f0 * t) + 0.5 * torch.sin(2 * math.pi * 2.1 * f0 * t))
        return wav + 0.35 * torch.randn(n, generator=g)

    def __getitem__(self, i):
        wav = self.load(i)
        start = int(torch.randint(0, wav.numel() - CROP, (1,)))  # zoo: place
        wav = wav[start:start + CROP]
        frames = wav.unfold(0, FRAME, HOP) * self.window
        spec = torch.fft.rfft(frames).abs()
        return torch.log1p(spec).T.contiguous(), self.labels[i]


class KeywordCNN(nn.Module):
    def __init__(self, n_bins=FRAME // 2 + 1, n_classes=len(KEYWORDS)):  # noqa: B008
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(n_bins, 64, 3, padding=1), nn.ReLU(),
            nn.Conv1d(64, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten(),
        )
        self.head = nn.Linear(64, n_classes)

    def forward(self, x):
        return self.head(self.body(x))


def run(rank, world, epochs=2, batch_size=32):
    torch.manual_seed(rank)                 # per-rank augmentation randomness
    dataset = FieldRecordings(3200, seed=41)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=17, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=0)

    torch.manual_seed(0)
    model = DDP(KeywordCNN())
    torch.manual_seed(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-2)
    step = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        correct = seen = 0
        for feats, labels in loader:
            logits = model(feats)
            loss = F.cross_entropy(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            correct += (logits.argmax(1) == labels).sum().item()
            seen += labels.numel()
            step += 1
            if step % 5 == 0:
                logger.info("epoch %d step %d loss %.3f", epoch, step, loss.item())
        logger.info("epoch %d done: train acc %.3f (%.1fs)", epoch, correct / max(seen, 1), time.time() - t0)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    try:
        run(rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
