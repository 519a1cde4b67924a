"""Bird species identification from field recordings, DDP on CPU.

What the job does
    Synthesises a manifest of field recordings of six songbird species (8 kHz,
    1.5-4 s each, a few uploads cut short by recorders that dropped out),
    renders each clip, takes a random 1 s training crop, turns it into a log
    power spectrogram and trains a small CNN. Data is sharded with a shuffling
    DistributedSampler; the DataLoader runs in the main process.

Root cause
    `random_crop` assumes every clip is at least CROP_SECONDS long. One upload in
    the manifest is 0.74 s; the sampler puts it in rank 1's shard, and when that
    rank reaches it `rng.integers(0, len(wave) - n + 1)` raises ValueError
    ("high <= 0"). That rank dies; the other rank is blocked in the gradient
    all-reduce of the same step and is torn down (connection closed / killed by
    torchrun).

Fix
    Validate the manifest (drop clips shorter than the crop) or pad short clips
    to the crop length before cropping.

Observed (plain run)
    rc 1 after ~5 s. Clip XC310245 (index 245, 0.74 s, great_tit) is in rank 1's
    shard; on rank 1's 10th step of epoch 0 (batch index 9) the DataLoader
    fetch goes through __getitem__ -> random_crop and raises
    "ValueError: high <= 0" at the marked line. Rank 0, already inside that
    step's loss.backward() (gradient all-reduce), then fails with
    "RuntimeError: ... pair.cc:553] Connection closed by peer ... typically
    caused by a remote worker crashing"; torchrun SIGTERMs it and, in 4 of 5
    runs, its summary names rank 1 (exitcode 1) as the root cause. In 1 of 5
    runs rank 0 additionally printed "terminate called without an active
    exception" and died with SIGABRT (-6) before rank 1 was reaped, so
    torchrun's "Root Cause" named rank 0 (-6) and listed rank 1 as SIGTERMed -
    the real cause is still rank 1's ValueError. No rank printed a step line
    (the first print is at step 10).
"""
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = {
    "kind": ["rank_failure"],
    "rank": 1,
    "fix": ["pad", "minimum length", "shorter", "filter", "skip", "drop"],
    "options": [],
}

SAMPLE_RATE = 8000
CROP_SECONDS = 1.0
SPECIES = ["wren", "robin", "blackbird", "chiffchaff", "blackcap", "great_tit"]
N_FFT, HOP = 256, 128


def build_manifest(n, seed):
    rng = np.random.default_rng(seed)
    species = rng.integers(0, len(SPECIES), size=n)
    seconds = rng.uniform(1.5, 4.0, size=n)
    # recorder drop-outs: a few uploads end early
    dropped = rng.random(n) < 0.003
    seconds[dropped] = rng.uniform(0.45, 0.8, size=int(dropped.sum()))
    return [
        {"clip_id": f"XC{310000 + i}", "species": int(s), "seconds": float(d), "seed": int(seed * 7919 + i)}
        for i, (s, d) in enumerate(zip(species, seconds))
    ]


def render_clip(rec):
    """Stand-in for decoding the upload: repeated FM chirps plus wind noise."""
    rng = np.random.default_rng(rec["seed"])
    n = int(rec["seconds"] * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    f0 = 900.0 + 420.0 * rec["species"]
    rate = 3.0 + 0.7 * rec["species"]
    phase = 2 * np.pi * (f0 * t + 180.0 * np.sin(2 * np.pi * rate * t) / (2 * np.pi * rate))
    envelope = np.clip(np.sin(2 * np.pi * rate * t + rng.uniform(0, 6.28)), 0, None) ** 2
    wave = 0.6 * envelope * np.sin(phase) + 0.08 * rng.standard_normal(n)
    return wave.astype(np.float32)


def random_crop(wave, n_samples, rng):
    start = int(rng.integers(0, len(wave) - n_samples + 1))  # zoo: place
    return wave[start:start + n_samples]


def log_spectrogram(wave):
    spec = torch.stft(torch.from_numpy(wave), n_fft=N_FFT, hop_length=HOP,
                      window=torch.hann_window(N_FFT), return_complex=True)
    return (spec.abs() ** 2 + 1e-6).log().unsqueeze(0)


class FieldRecordings(Dataset):
    def __init__(self, manifest, crop_seconds, seed):
        self.manifest = manifest
        self.n_crop = int(crop_seconds * SAMPLE_RATE)
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return len(self.manifest)

    def __getitem__(self, idx):
        rec = self.manifest[idx]
        wave = render_clip(rec)
        wave = random_crop(wave, self.n_crop, self.rng)
        return log_spectrogram(wave), rec["species"]


class SongCNN(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 48, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(48, n_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ckpt_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "birdsong")
    os.makedirs(ckpt_dir, exist_ok=True)

    manifest = build_manifest(480, seed=4)
    ds = FieldRecordings(manifest, CROP_SECONDS, seed=100 + rank)
    sampler = DistributedSampler(ds, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=0)

    model = DDP(SongCNN(len(SPECIES)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    step = 0
    for epoch in range(3):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for spec, label in loader:
            loss = F.cross_entropy(model(spec), label)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 10 == 0:
                print(f"step {step} loss {loss.item():.3f}", flush=True)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.1f}s", flush=True)
            torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "songcnn.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
