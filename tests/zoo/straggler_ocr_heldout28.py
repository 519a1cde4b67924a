"""Text-line OCR (CRNN-style conv + CTC) trained with DDP (gloo, CPU).

What the job does
    The corpus is a paired set of text lines: every line exists as a born-digital
    render (32x128) and as a 4x-resolution scan of the printed page (128x512, speckle
    and uneven illumination).  The pairs are stored interleaved
    [digital_0, scan_0, digital_1, scan_1, ...].  Scans are cleaned in the data path
    (median-filter despeckling at scan resolution, then downsampling to 32x128) and a
    small conv net with a CTC head is trained on both.  Sharding uses
    DistributedSampler with shuffle=False "so both versions of a line stay in step".

Root cause
    With shuffle=False DistributedSampler deals indices round-robin, so rank 0 gets
    every even index (all born-digital lines) and rank 1 every odd index (all scans).
    Only rank 1 ever runs despeckle() on 128x512 scans, so its data loading is many
    times slower every step and rank 0 waits for it in each gradient all-reduce:
    a persistent straggler on rank 1.

Fix
    Balance the expensive samples across ranks: shuffle=True (with set_epoch), or
    pre-clean the scans once offline / in DataLoader workers (num_workers>0), so no
    rank carries all of the despeckling.

Observed (plain run: OMP_NUM_THREADS=1 timeout 90 torchrun --standalone --nproc_per_node 2)
    Exit code 0 in ~16-21 s; last lines "epoch 1 step 15 ctc 4.653 (0.595 s/step)"
    and "done: 20 steps in 11.9 s".  Instrumented run (time spent in DataLoader
    __next__ and in backward per rank): rank 1 spent 10.7 s fetching its 20 batches
    (~0.5 s per batch, all in despeckle) vs 0.06 s on rank 0, and rank 0 spent 10.6 s
    in backward (waiting in the gradient all-reduce) vs 0.7 s on rank 1.  Replicas
    identical at the end.
"""
import gc
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = {
    "kind": ["straggler"],
    "rank": 1,
    "fix": ["shuffle", "balance", "num_workers", "offline", "precompute", "data loading"],
    "options": [],
}

SEED = 777
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
N_LINES = 160                   # -> 320 samples
H, W = 32, 128
SCAN_SCALE = 4
GLYPH_H, GLYPH_W, PITCH = 20, 10, 12
BATCH = 16
EPOCHS = 2
OUT_DIR = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "ocr_crnn")


def glyph_bank(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(len(ALPHABET), GLYPH_H, GLYPH_W, generator=g) > 0.55).float()


def despeckle(page, k=5):
    """k x k median filter (salt & pepper removal) on a single-channel page."""
    pad = k // 2
    padded = F.pad(page[None, None], (pad, pad, pad, pad), mode="reflect")
    patches = F.unfold(padded, kernel_size=k)           # (1, k*k, H*W)
    return patches.median(dim=1).values.view_as(page)


class PairedLineDataset(Dataset):
    def __init__(self, n_lines, seed):
        self.n_lines = n_lines
        self.seed = seed
        self.glyphs = glyph_bank(seed)

    def __len__(self):
        return 2 * self.n_lines

    def text_of(self, line):
        g = torch.Generator().manual_seed(self.seed + 31 * line)
        n = int(torch.randint(4, 9, (1,), generator=g))
        return torch.randint(0, len(ALPHABET), (n,), generator=g)

    def render(self, codes):
        img = torch.zeros(H, W)
        for j, c in enumerate(codes.tolist()):
            x0 = 4 + j * PITCH
            img[6:6 + GLYPH_H, x0:x0 + GLYPH_W] = self.glyphs[c]
        return img

    def __getitem__(self, idx):
        line, is_scan = divmod(idx, 2)
        codes = self.text_of(line)
        img = self.render(codes)
        g = torch.Generator().manual_seed(self.seed * 13 + idx)
        if is_scan:
            page = F.interpolate(img[None, None], scale_factor=SCAN_SCALE, mode="bilinear",
                                 align_corners=False)[0, 0]
            ramp = torch.linspace(0.85, 1.15, page.shape[1])
            page = page * ramp + 0.05 * torch.randn(page.shape, generator=g)
            speckle = torch.rand(page.shape, generator=g)
            page = torch.where(speckle < 0.03, torch.ones_like(page), page)
            page = torch.where(speckle > 0.97, torch.zeros_like(page), page)
            page = despeckle(page)  # zoo: place
            img = F.interpolate(page[None, None], size=(H, W), mode="area")[0, 0]
        else:
            img = img + 0.02 * torch.randn(img.shape, generator=g)
        target = torch.zeros(8, dtype=torch.long)
        target[: len(codes)] = codes + 1                 # 0 is the CTC blank
        return img[None], target, len(codes)


class LineRecognizer(nn.Module):
    def __init__(self, n_symbols):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),       # 16 x 64
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),      # 8 x 32
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        )
        self.proj = nn.Linear(64 * 8, 128)
        self.out = nn.Linear(128, n_symbols + 1)

    def forward(self, x):
        f = self.conv(x)                                   # B, C, 8, 32
        b, c, h, w = f.shape
        f = f.permute(3, 0, 1, 2).reshape(w, b, c * h)     # T, B, C*H
        return self.out(F.relu(self.proj(f))).log_softmax(-1)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)

    ds = PairedLineDataset(N_LINES, SEED)
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler)

    model = DDP(LineRecognizer(len(ALPHABET)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    step = 0
    t0 = time.time()
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for imgs, targets, lengths in loader:
            log_probs = model(imgs)
            input_lengths = torch.full((imgs.shape[0],), log_probs.shape[0], dtype=torch.long)
            flat_targets = torch.cat([t[:n] for t, n in zip(targets, lengths.tolist())])
            loss = ctc(log_probs, flat_targets, input_lengths, lengths)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 5 == 0:
                print(f"epoch {epoch} step {step} ctc {loss.item():.3f} "
                      f"({(time.time() - t0) / (step + 1):.3f} s/step)", flush=True)
            step += 1

    if rank == 0:
        os.makedirs(OUT_DIR, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(OUT_DIR, "crnn.pt"))
    dist.barrier()
    if rank == 0:
        print(f"done: {step} steps in {time.time() - t0:.1f} s", flush=True)
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
