"""A spectrum whose peak sits exactly on its baseline kills rank 0 with "math domain error".

Story: a small classifier of compound families from centroided mass spectra.  Each spectrum
is stored as a peak list (m/z, intensity, local baseline) exported by the vendor software;
`bin_spectrum` subtracts the baseline and takes `math.log` of each peak's height before
binning it into a fixed m/z grid.  The run files are split by instrument: rank 0 reads the
Orbitrap runs, rank 1 the Q-TOF runs.  One Orbitrap run (spectrum 203 of rank 0's shard)
has a peak that the exporter clipped to its baseline, so its height is exactly 0.0 and
`math.log(0.0)` raises "ValueError: math domain error" in the dataset's __getitem__ at step 12
of the first epoch.  Rank 0 dies with that traceback; rank 1, already waiting in the gradient
all-reduce of that step, loses its peer and fails with a gloo connection error.

Root cause: rank 0 (the ValueError in bin_spectrum, on the clipped peak).
Fix: guard the log (`math.log(max(height, eps))` or `log1p`), or drop peaks at or below the
baseline when the peak lists are loaded; rank 1's error is only the consequence.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["rank_failure"],
    "rank": 0,
    "fix": ["baseline", "log1p", "eps", "epsilon", "max(", "clamp", "clip", "guard", "zero",
            "non-positive", "positive", "math domain", "ValueError", "log", "validate",
            "exception", "traceback", "drop"],
    "options": [],
}

FAMILIES = 4
BINS = 160
MZ_LO, MZ_HI = 100.0, 900.0
PEAKS = 40


class PeakLists(Dataset):
    """One rank's spectra as peak lists [(mz, intensity, baseline), ...] with a family label."""

    def __init__(self, instrument, n=384):
        g = torch.Generator().manual_seed(11 + instrument)
        signature = torch.rand(FAMILIES, 6, generator=torch.Generator().manual_seed(3)) * 700 + 120
        self.items = []
        for k in range(n):
            fam = int(torch.randint(0, FAMILIES, (1,), generator=g))
            mz = torch.cat([signature[fam] + torch.randn(6, generator=g) * 0.5,
                            torch.rand(PEAKS - 6, generator=g) * (MZ_HI - MZ_LO) + MZ_LO])
            base = torch.rand(PEAKS, generator=g) * 50 + 10
            height = torch.cat([torch.rand(6, generator=g) * 5e4 + 1e4,
                                torch.rand(PEAKS - 6, generator=g) * 3e3 + 20])
            peaks = [(float(m), float(b + h), float(b)) for m, h, b in zip(mz, height, base)]
            if instrument == 0 and k == 203:  # exporter clipped one peak to its baseline
                m, _, b = peaks[17]
                peaks[17] = (m, b, b)
            self.items.append((peaks, fam))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        peaks, fam = self.items[i]
        return bin_spectrum(peaks), fam


def bin_spectrum(peaks):
    spectrum = [0.0] * BINS
    for mz, intensity, baseline in peaks:
        height = intensity - baseline
        level = math.log(height)  # zoo: place
        b = min(BINS - 1, int((mz - MZ_LO) / (MZ_HI - MZ_LO) * BINS))
        spectrum[b] = max(spectrum[b], level)
    return torch.tensor(spectrum)


class FamilyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(BINS, 128), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, FAMILIES))

    def forward(self, x):
        return self.net(x / 10.0)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(FamilyNet())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    spectra = PeakLists(instrument=rank)
    loader = DataLoader(spectra, batch_size=16, shuffle=False)
    for epoch in range(4):
        total, correct = 0, 0
        for _step, (x, fam) in enumerate(loader):
            logits = model(x)
            loss = F.cross_entropy(logits, fam)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += len(fam)
            correct += (logits.argmax(-1) == fam).sum().item()
        print(f"rank {rank} epoch {epoch}: acc {correct / total:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
