"""Batches materialised once with list(loader): every epoch after the first replays epoch 0.

Story: a human-activity classifier on accelerometer windows.  Each window is featurised in
the dataset's __getitem__ (band energies from an rFFT of each axis, a few statistics), which
the author found slow, so the training script "featurises once": right after building the
DataLoader it runs `train_batches = list(train_loader)` and the epoch loop then iterates that
list.  The loop still looks textbook: `sampler.set_epoch(epoch)` at the top of every epoch, a
DistributedSampler with shuffle=True.  But list() drove the loader through a single pass (the
sampler's epoch 0 order) and kept the collated batches; the sampler is never asked for another
order, so epochs 1..4 train on exactly the batches of epoch 0, in the same order, on every rank.

Root cause: no single rank; every rank replays its first pass (set_epoch reaches a sampler
that nothing iterates again).
Fix: iterate the loader in each epoch (`for x, y in train_loader` after `set_epoch(epoch)`);
cache the featurised windows in the Dataset (per sample), not the batches.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = {
    "kind": ["missing_set_epoch"],
    "rank": None,
    "fix": ["new pass", "iterate", "each epoch", "every epoch", "set_epoch", "cycle", "list("],
    "options": [],
}

ACTIVITIES = ["walk", "run", "sit", "stairs_up", "stairs_down", "cycle"]
WINDOW = 128  # samples at 50 Hz


class AccelWindows(Dataset):
    """Synthetic 3-axis accelerometer windows; each activity has its own gait frequency."""

    def __init__(self, n=1024, seed=11):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, len(ACTIVITIES), (n,), generator=g)
        t = torch.arange(WINDOW) / 50.0
        freq = (0.8 + 0.5 * self.labels.float()).unsqueeze(1)
        phase = torch.rand(n, 3, generator=g) * 2 * math.pi
        base = torch.sin(2 * math.pi * freq.unsqueeze(1) * t + phase.unsqueeze(2))
        self.raw = base + 0.3 * torch.randn(n, 3, WINDOW, generator=g)

    def __len__(self):
        return len(self.labels)

    def featurise(self, w):
        spec = torch.fft.rfft(w, dim=-1).abs()[:, 1:33]       # 3 x 32 band magnitudes
        bands = spec.reshape(3, 8, 4).mean(-1)                # 3 x 8 coarse bands
        stats = torch.stack([w.mean(-1), w.std(-1), w.abs().max(-1).values], -1)
        return torch.cat([bands.flatten(), stats.flatten()])  # 24 + 9 features

    def __getitem__(self, i):
        return self.featurise(self.raw[i]), self.labels[i]


class ActivityNet(nn.Module):
    def __init__(self, n_in=33, hidden=96):
        super().__init__()
        self.norm = nn.LayerNorm(n_in)
        self.body = nn.Sequential(nn.Linear(n_in, hidden), nn.GELU(),
                                  nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, len(ACTIVITIES))

    def forward(self, x):
        return self.head(self.body(self.norm(x)))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    data = AccelWindows()
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    train_loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    # featurising is the slow part and the windows never change: do it once up front
    train_batches = list(train_loader)  # zoo: place

    model = DDP(ActivityNet())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5 * len(train_batches))

    for epoch in range(5):
        sampler.set_epoch(epoch)
        model.train()
        total, correct, seen = 0.0, 0, 0
        for feats, label in train_batches:
            logits = model(feats)
            loss = F.cross_entropy(logits, label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(label)
            correct += (logits.argmax(1) == label).sum().item()
            seen += len(label)
        if rank == 0:
            print(f"epoch {epoch}: loss {total / seen:.3f} acc {correct / seen:.2%}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
