"""Music genre classification from raw waveforms (8 genres).

Each rank reads its own shard of the catalogue and turns raw audio into log-spectrograms on
the fly, then a small CNN classifies 2-second excerpts. The catalogue has two sources: the old
16 kHz preview clips and a newer 96 kHz hi-res batch; the sharding puts the hi-res batch on
rank 1. featurize() is supposed to bring every clip to 16 kHz first, but it only resamples when
the rate is *not a multiple* of 16 kHz (a shortcut for 44.1 kHz material), and "handles" 96 kHz
by computing a 6x longer STFT at the native rate and pooling the frames afterwards. Rank 1
therefore does several times the feature-extraction work of rank 0 on every step and rank 0
spends most of each step waiting for it inside the gradient all-reduce.

Root cause: featurize() runs the STFT at the native 96 kHz rate for rank 1's clips instead of
resampling to 16 kHz first -- extra per-step CPU work on rank 1 only.
Plain run (measured, 60 steps, two runs): local work (featurize+forward) rank 0 0.021-0.031
s/step vs rank 1 0.106-0.126 s/step (4-5x); both ranks' total step time 0.118-0.137 s/step, i.e.
rank 0 waits ~0.09 s/step in the backward all-reduce; job exits 0 in ~12-13 s.
Fix: resample to the model rate (16 kHz) before the STFT for every clip (or precompute the
features offline / cache them) so both ranks do the same amount of preprocessing.
"""

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": ["straggler"],
    "rank": 1,
    "fix": [
        "resample",
        "16 khz",
        "16k",
        "sample rate",
        "precompute",
        "cache",
        "offline",
        "preprocess",
        "balance",
        "stft",
        "feature",
        "slow",
        "same amount",
        "downsample",
    ],
    "options": [],
}

GENRES = 8
MODEL_SR = 16000
CLIP_S = 2.0
N_FFT, HOP = 512, 256


def synth_clip(genre, sr, g):
    t = torch.arange(int(sr * CLIP_S)) / sr
    f0 = 110 * 2 ** (genre / 4)
    wave = sum(torch.sin(2 * math.pi * f0 * h * t) / h for h in range(1, 4))
    beat = (torch.sin(2 * math.pi * (1 + genre * 0.4) * t) > 0.9).float()
    return wave * (0.5 + beat) + 0.1 * torch.randn(t.shape, generator=g)


def featurize(wave, sr):
    if sr % MODEL_SR != 0:  # zoo: place
        wave = F.interpolate(wave[None, None], scale_factor=MODEL_SR / sr, mode="linear")[0, 0]
        sr = MODEL_SR
    k = sr // MODEL_SR
    spec = torch.stft(
        wave, n_fft=N_FFT * k, hop_length=HOP, window=torch.hann_window(N_FFT * k), return_complex=True
    )
    mag = spec.abs()[: N_FFT // 2 + 1]
    mag = F.avg_pool1d(mag[None], kernel_size=k, stride=k)[0]
    return torch.log1p(mag[:, :124])


class GenreCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(4),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d((4, 4)),
        )
        self.head = nn.Linear(16 * 16, GENRES)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    source_sr = MODEL_SR if rank == 0 else 96000  # catalogue shard: previews vs hi-res batch
    g = torch.Generator().manual_seed(rank)
    torch.manual_seed(0)
    model = DDP(GenreCNN())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    bs, steps = 6, 60
    work_t, step_t = 0.0, 0.0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        labels = torch.randint(0, GENRES, (bs,), generator=g)
        feats = torch.stack([featurize(synth_clip(int(lab), source_sr, g), source_sr) for lab in labels])
        logits = model(feats[:, None])
        loss = F.cross_entropy(logits, labels)
        t1 = time.perf_counter()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t2 = time.perf_counter()
        work_t += t1 - t0
        step_t += t2 - t0
        if step % 20 == 0:
            print(
                f"rank {rank} step {step} loss {loss.item():.3f} local work {work_t / step:.3f}s/step "
                f"total {step_t / step:.3f}s/step",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
