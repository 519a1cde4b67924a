"""Line-level OCR (CTC) for scanned invoice lines.

A conv + GRU recogniser reads synthetic text-line images (glyph strips rendered from random
digit strings) and is trained with CTC loss. Lines in a batch are padded to the widest line
of that batch. Every 10 steps the job logs an "ink profile": the mean column darkness of the
batch, summed over ranks with all_reduce, which the team uses to spot scanner drift.

Root cause: ink_profile() returns a vector whose length is the padded width of the local batch,
which depends on the longest string this rank happened to draw. Rank 1's shard holds the long
invoice-total lines (12-30 glyphs, up to 240 columns) while rank 0's lines have 4-18 glyphs (at
most 144 columns), so at step 10 the two ranks all_reduce tensors of different lengths.
Plain run (measured): at step 10 rank 0 aborts with gloo::EnforceNotMet "op.preamble.length <=
op.nbytes. 224 vs 120. Received data size doesn't match expected size. Is there a distributed
collective mismatch", rank 1 fails in dist.all_reduce(prof) with "Connection reset by peer";
torchrun exits 1 after ~5 s.
Fix: make the collective the same shape on every rank -- pad/resize the profile to a fixed
width (or reduce a fixed-size summary such as mean and std) before all_reduce.
"""

import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": ["collective_mismatch", "rank_failure"],
    "rank": None,
    "fix": [
        "shape",
        "same shape",
        "same size",
        "fixed",
        "fixed width",
        "pad",
        "resize",
        "width",
        "size",
        "consistent",
        "match",
        "every rank",
        "all ranks",
        "summary",
    ],
    "options": [],
}

ALPHABET = "0123456789.,"
GLYPH_W, H = 8, 16


def glyph_bank(seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(len(ALPHABET), H, GLYPH_W, generator=g) > 0.55).float()


def render(text, bank, rng):
    cols = [bank[ALPHABET.index(c)] for c in text]
    img = torch.cat(cols, dim=1)
    img = img + 0.15 * torch.randn(img.shape, generator=rng)
    return img


def synth_lines(n, rank, seed):
    rng = random.Random(seed)
    # rank 1's shard comes from the "totals" page: long amounts with separators
    lo, hi = (4, 18) if rank == 0 else (12, 30)
    out = []
    for _ in range(n):
        k = rng.randint(lo, hi)
        out.append("".join(rng.choice(ALPHABET) for _ in range(k)))
    return out


def collate(texts, bank, g):
    imgs = [render(t, bank, g) for t in texts]
    width = max(im.shape[1] for im in imgs)
    batch = torch.zeros(len(imgs), 1, H, width)
    for i, im in enumerate(imgs):
        batch[i, 0, :, : im.shape[1]] = im
    targets = torch.tensor([ALPHABET.index(c) + 1 for t in texts for c in t])
    lengths = torch.tensor([len(t) for t in texts])
    return batch, targets, lengths


class Recogniser(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d((2, 2)),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d((2, 1)),
        )
        self.rnn = nn.GRU(32 * (H // 4), 48, batch_first=True, bidirectional=True)
        self.out = nn.Linear(96, len(ALPHABET) + 1)

    def forward(self, x):
        f = self.conv(x)  # B, C, H/4, W/2
        b, c, h, w = f.shape
        f = f.permute(0, 3, 1, 2).reshape(b, w, c * h)
        o, _ = self.rnn(f)
        return self.out(o)  # B, T, K


def ink_profile(batch):
    """Mean darkness per pixel column of the (padded) batch."""
    return batch.mean(dim=(0, 1, 2))  # zoo: place


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bank = glyph_bank()
    texts = synth_lines(800, rank, seed=100 + rank)
    g = torch.Generator().manual_seed(rank)
    torch.manual_seed(0)
    model = DDP(Recogniser())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    bs = 16
    for step in range(1, 61):
        i = (step * bs) % (len(texts) - bs)
        x, tgt, tlen = collate(texts[i : i + bs], bank, g)
        logp = F.log_softmax(model(x), -1).transpose(0, 1)
        in_len = torch.full((x.shape[0],), logp.shape[0], dtype=torch.long)
        loss = ctc(logp, tgt, in_len, tlen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            prof = ink_profile(x)
            dist.all_reduce(prof)
            if rank == 0:
                print(f"step {step} ctc {loss.item():.3f} ink mean {prof.mean().item() / 2:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
