"""ECG rhythm classification (NSR / AF / sinus brady / sinus tachy) from 2-lead,
5 s, 200 Hz strips, trained with DDP (gloo, CPU).

What the job does
    Metadata for 384 strips is merged from two annotation sites: site A writes rhythm
    abbreviations, site B writes SNOMED-CT codes that load_metadata() translates with
    SNOMED_TO_RHYTHM.  Waveforms are synthesised deterministically per record (beat
    templates at a rhythm-dependent RR interval, fibrillatory/flutter baseline where
    appropriate).  A 1-D CNN is trained with DistributedSampler (catalogue order,
    4 epochs).

Root cause
    SNOMED_TO_RHYTHM knows atrial flutter (164890007 -> "AFL"), but the label table the
    model is trained on, RHYTHM_TO_IDX, has no "AFL" entry.  Exactly one site-B record
    (index 235) is atrial flutter; it falls into rank 1's shard, so
    ECGStripDataset.__getitem__ raises KeyError('AFL') on rank 1 only, at epoch 0
    step 7.  Rank 0 is then blocked in the gradient all-reduce of its step 7 until
    torchrun tears it down.

Fix
    Validate / map labels for the whole metadata before training (add "AFL" to
    RHYTHM_TO_IDX with a matching head size, or drop / remap unknown rhythms when the
    metadata is loaded) so no rank can meet an unmapped label mid-epoch.

Observed (plain run: OMP_NUM_THREADS=1 timeout 90 torchrun --standalone --nproc_per_node 2)
    Exit code 1 after ~5 s.  Rank 1 raises `KeyError: 'AFL'` from
    ECGStripDataset.__getitem__ (the RHYTHM_TO_IDX lookup) while fetching its batch 7
    of epoch 0; rank 0, blocked in loss.backward() of step 7, then fails with
    "RuntimeError: [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    and is SIGTERMed by torchrun.  torchrun's summary: ChildFailedError,
    "Root Cause (first observed failure): rank 1 (local_rank: 1) exitcode 1",
    rank 0 listed with exitcode -15 (SIGTERM).  No epoch line was printed.
"""
import gc
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = {
    "kind": ["rank_failure"],
    "rank": 1,
    "fix": ["AFL", "KeyError", "RHYTHM_TO_IDX", "label map"],
    "options": [],
}

SEED = 20240
FS = 200
DURATION_S = 5
N_RECORDS = 384
BATCH = 16
EPOCHS = 4
OUT_DIR = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "ecg_rhythm")

RHYTHM_TO_IDX = {"NSR": 0, "AF": 1, "SB": 2, "ST": 3}
SNOMED_TO_RHYTHM = {
    "426783006": "NSR",
    "164889003": "AF",
    "426177001": "SB",
    "427084000": "ST",
    "164890007": "AFL",
}
HEART_RATE = {"NSR": 72, "AF": 95, "SB": 48, "ST": 118, "AFL": 75}
FLUTTER_RECORDS = {235}


def load_metadata(n, seed):
    g = torch.Generator().manual_seed(seed)
    site_b = torch.rand(n, generator=g) < 0.4
    rhythm_draw = torch.randint(0, 4, (n,), generator=g)
    abbrevs = list(RHYTHM_TO_IDX)
    codes = [c for c, r in SNOMED_TO_RHYTHM.items() if r in RHYTHM_TO_IDX]
    records = []
    for i in range(n):
        if i in FLUTTER_RECORDS:
            records.append({"id": f"B{i:05d}", "site": "B", "rhythm": SNOMED_TO_RHYTHM["164890007"]})
        elif site_b[i]:
            records.append({"id": f"B{i:05d}", "site": "B", "rhythm": SNOMED_TO_RHYTHM[codes[int(rhythm_draw[i])]]})
        else:
            records.append({"id": f"A{i:05d}", "site": "A", "rhythm": abbrevs[int(rhythm_draw[i])]})
    return records


def synth_strip(rhythm, seed):
    g = torch.Generator().manual_seed(seed)
    n = FS * DURATION_S
    t = torch.arange(n, dtype=torch.float32) / FS
    rr = 60.0 / HEART_RATE[rhythm]
    sig = torch.zeros(n)
    beat_t = float(torch.rand(1, generator=g)) * rr
    while beat_t < DURATION_S:
        if rhythm not in ("AF", "AFL"):
            sig += 0.15 * torch.exp(-((t - beat_t + 0.16) / 0.025) ** 2)      # P wave
        sig += 1.0 * torch.exp(-((t - beat_t) / 0.012) ** 2)                   # QRS
        sig += 0.3 * torch.exp(-((t - beat_t - 0.28) / 0.05) ** 2)            # T wave
        jitter = 0.25 * (float(torch.rand(1, generator=g)) - 0.5) if rhythm == "AF" else 0.0
        beat_t += rr * (1.0 + jitter)
    if rhythm == "AF":
        sig += 0.05 * torch.sin(2 * math.pi * 6.5 * t + float(torch.rand(1, generator=g)) * 6.28)
    if rhythm == "AFL":
        sig += 0.12 * ((t * 5.0) % 1.0 - 0.5)                                   # saw-tooth F waves
    baseline = 0.1 * torch.sin(2 * math.pi * 0.3 * t)
    lead_ii = sig + baseline + 0.03 * torch.randn(n, generator=g)
    lead_v1 = -0.6 * sig + baseline + 0.03 * torch.randn(n, generator=g)
    return torch.stack([lead_ii, lead_v1])


def standardise(x):
    x = x - x.mean(dim=-1, keepdim=True)
    return x / (x.std(dim=-1, keepdim=True) + 1e-6)


class ECGStripDataset(Dataset):
    def __init__(self, records, seed):
        self.records = records
        self.seed = seed

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        rec = self.records[idx]
        x = standardise(synth_strip(rec["rhythm"], self.seed + idx))
        y = RHYTHM_TO_IDX[rec["rhythm"]]  # zoo: place
        return x, y


class RhythmNet(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(2, 16, 9, padding=4), nn.ReLU(), nn.MaxPool1d(4),
            nn.Conv1d(16, 32, 9, padding=4), nn.ReLU(), nn.MaxPool1d(4),
            nn.Conv1d(32, 32, 5, padding=2), nn.ReLU(),
        )
        self.classifier = nn.Linear(64, n_classes)

    def forward(self, x):
        h = self.body(x)
        h = torch.cat([h.mean(-1), h.amax(-1)], dim=1)
        return self.classifier(h)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)

    records = load_metadata(N_RECORDS, SEED)
    ds = ECGStripDataset(records, SEED)
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler)

    model = DDP(RhythmNet(len(RHYTHM_TO_IDX)))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        total, correct, loss_sum = 0, 0, 0.0
        for step, (x, y) in enumerate(loader):  # noqa: B007
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(y)
            correct += (logits.argmax(1) == y).sum().item()
            total += len(y)
        stats = torch.tensor([loss_sum, correct, total], dtype=torch.float64)
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch}: loss {stats[0] / stats[2]:.4f} acc {stats[1] / stats[2]:.3f}", flush=True)

    if rank == 0:
        os.makedirs(OUT_DIR, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(OUT_DIR, "rhythmnet.pt"))
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
