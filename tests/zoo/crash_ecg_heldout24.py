"""Arrhythmia beat classifier (N / S / V / F) on single-lead ECG, trained with DDP.

Story
-----
Holter recordings from several hospital sites are cut into beat-centred windows around the
annotated R peaks; a small 1-D CNN classifies each beat.  Data is sharded by *site* (a common
choice for federated-style bookkeeping): rank r trains on the sites with `site % world == r`.
Windows are cut lazily in `BeatWindows.__getitem__`.

Root cause
----------
Beat annotations are MIT-BIH style symbols, mapped to the four AAMI classes by `LABEL_MAP` in
`BeatWindows.__getitem__`.  One recording from site 3 contains a single beat annotated 'Q'
(unclassifiable), a symbol that `LABEL_MAP` does not know, so the lookup raises KeyError: 'Q'
when that beat is drawn.  Site 3 belongs to rank 1, so only rank 1 crashes, part-way through the
first epoch, in its data path; rank 0 is left waiting in DDP's gradient all-reduce until gloo
notices that the peer is gone.
Fix: filter beats whose symbol is not in LABEL_MAP when building the index (AAMI practice is to
drop 'Q' beats), or map them explicitly.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): exit code 1 after ~5 s.
Rank 1 raises KeyError: 'Q' from BeatWindows.__getitem__ (DataLoader fetch) at step 4 of 6 in
epoch 0, after 4 good DDP steps; rank 0 then dies in DDP's forward (buffer broadcast) with
"Connection closed by peer"; torchrun names rank 1 (exitcode 1) as the first failure and
SIGTERMs rank 0.
"""
import logging
import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

EXPECT = {
    "kind": ["rank_failure", "rank_left_early"],
    "rank": 1,
    "fix": ["label_map", "q"],
    "options": [],
}

FS = 360            # MIT-BIH style sampling rate
HALF = 128          # window = 256 samples (~0.7 s)
CLASSES = ["N", "S", "V", "F"]
SYMBOLS = ["N", "A", "V", "F"]          # symbols the simulator emits per class
LABEL_MAP = {"N": 0, "L": 0, "R": 0, "e": 0, "j": 0, "A": 1, "a": 1, "J": 1, "S": 1,
             "V": 2, "E": 2, "F": 3}
SITES = 6
RECORDS_PER_SITE = 5
EPOCHS = 3
BATCH = 64
SEED = 2024

log = logging.getLogger("ecg")


@dataclass
class Recording:
    rid: str
    site: int
    fs: int
    signal: torch.Tensor   # (n_samples,)
    peaks_sec: torch.Tensor
    symbols: list


def beat_template(kind, fs, g):
    t = torch.arange(-HALF, HALF).float() / fs
    width = {0: 0.012, 1: 0.012, 2: 0.035, 3: 0.022}[kind]
    amp = {0: 1.0, 1: 0.9, 2: 1.6, 3: 1.2}[kind]
    qrs = amp * torch.exp(-(t / width) ** 2)
    p_shift = -0.09 if kind == 1 else -0.16
    p_wave = 0.0 if kind == 2 else 0.15 * torch.exp(-((t - p_shift) / 0.025) ** 2)
    t_wave = (-0.4 if kind == 2 else 0.3) * torch.exp(-((t - 0.25) / 0.05) ** 2)
    return qrs + p_wave + t_wave + 0.02 * torch.randn(t.shape, generator=g)


def synth_recording(rid, site, fs, seconds, g):
    n = int(seconds * fs)
    sig = 0.05 * torch.randn(n, generator=g) + 0.1 * torch.sin(torch.arange(n) / fs * 0.6)
    peaks, symbols = [], []
    t = 0.6
    while t < seconds - 0.6:
        kind = int(torch.multinomial(torch.tensor([0.7, 0.1, 0.15, 0.05]), 1, generator=g))
        c = int(round(t * fs))
        tmpl = beat_template(kind, fs, g)
        lo, hi = max(0, c - HALF), min(n, c + HALF)
        sig[lo:hi] += tmpl[lo - (c - HALF):hi - (c - HALF)]
        peaks.append(t)
        symbols.append(SYMBOLS[kind])
        t += 0.55 if kind == 1 else 0.8 + 0.2 * float(torch.rand(1, generator=g))
    return Recording(rid, site, fs, sig, torch.tensor(peaks), symbols)


def load_archive():
    g = torch.Generator().manual_seed(SEED)
    recs = []
    for site in range(SITES):
        for k in range(RECORDS_PER_SITE):
            recs.append(synth_recording(f"s{site}r{k}", site, FS, 30, g))
    recs[3 * RECORDS_PER_SITE + 2].symbols[17] = "Q"   # one unclassifiable beat at site 3
    return recs


class BeatWindows(Dataset):
    def __init__(self, recordings):
        self.recs = recordings
        self.index = [(ri, bi) for ri, r in enumerate(recordings) for bi in range(len(r.symbols))]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        ri, bi = self.index[i]
        rec = self.recs[ri]
        t_sec = float(rec.peaks_sec[bi])
        center = int(round(t_sec * rec.fs))
        seg = rec.signal[max(0, center - HALF):center + HALF]
        if center - HALF < 0:
            seg = F.pad(seg, (HALF - center, 0))
        if len(seg) < 2 * HALF:
            seg = F.pad(seg, (0, 2 * HALF - len(seg)))
        seg = (seg - seg.mean()) / (seg.std() + 1e-6)
        label = LABEL_MAP[rec.symbols[bi]]  # zoo: place
        return seg.unsqueeze(0), label


class BeatCNN(nn.Module):
    def __init__(self, n_cls=len(CLASSES)):  # noqa: B008
        super().__init__()
        chans = [1, 16, 32, 48]
        layers = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            layers += [nn.Conv1d(cin, cout, 7, padding=3), nn.BatchNorm1d(cout), nn.ReLU(),
                       nn.MaxPool1d(2)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(chans[-1], n_cls))

    def forward(self, x):
        return self.classifier(self.features(x).mean(-1))


def class_weights(ds):
    labels = [LABEL_MAP.get(s, 0) for r in ds.recs for s in r.symbols]
    counts = torch.bincount(torch.tensor(labels), minlength=len(CLASSES))
    counts = counts.float()
    dist.all_reduce(counts)
    return (counts.sum() / (len(CLASSES) * counts.clamp(min=1))).sqrt()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED)

    archive = load_archive()
    mine = [r for r in archive if r.site % world == rank]
    train_recs = [r for r in mine if not r.rid.endswith("r0")]
    val_recs = [r for r in mine if r.rid.endswith("r0")]
    train_ds, val_ds = BeatWindows(train_recs), BeatWindows(val_recs)
    log.info("sites %s: %d train beats, %d val beats", sorted({r.site for r in mine}),
             len(train_ds), len(val_ds))
    g = torch.Generator().manual_seed(SEED + rank)
    train_dl = DataLoader(train_ds, batch_size=BATCH, shuffle=True, generator=g, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=256)

    model = DDP(BeatCNN())
    weights = class_weights(train_ds)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    ckpt = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "beatcnn_ho24.pt")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)

    # Both ranks must run the same number of steps per epoch.
    steps = torch.tensor(len(train_dl))
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    steps = int(steps)

    for epoch in range(EPOCHS):
        model.train()
        t0, tot = time.time(), 0.0
        for step, (x, y) in enumerate(train_dl):
            if step >= steps:
                break
            loss = F.cross_entropy(model(x), y, weight=weights)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += loss.item()
        model.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for x, y in val_dl:
                correct += torch.tensor([(model.module(x).argmax(1) == y).sum().item(), len(y)])
        dist.all_reduce(correct)
        if rank == 0:
            log.info("epoch %d loss %.4f val_acc %.3f (%.1fs)", epoch, tot / steps,
                     (correct[0] / correct[1]).item(), time.time() - t0)
            torch.save({"epoch": epoch, "state": model.module.state_dict()}, ckpt)

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] param checksum {checksum:.10f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
