"""Freeway speed forecasting (next 15/30/45 min) from loop-detector history, trained with DDP.

Story
-----
Every loop detector reports the mean speed every 15 minutes.  A GRU reads the last 3 hours
(12 readings + time-of-day encoding + a learned detector embedding) and forecasts the next three
readings.  To keep each detector's series in one process, the job shards *detectors* across
ranks (`DETECTORS[rank::world]`) and each rank builds sliding windows from its own detectors.

Root cause
----------
Detectors do not have the same amount of history: several were installed late or have long
outages, and they happen to fall on rank 1.  Rank 0 therefore gets noticeably more windows, hence
more batches per epoch, than rank 1.  The training loop iterates over the local loader without
any agreement on the number of steps (no DistributedSampler over windows, no `model.join()`, no
min-steps all_reduce), so rank 1 finishes its epoch while rank 0 is still in the middle of DDP
backward passes: the ranks' collectives stop lining up (rank 1's validation all_reduce meets
rank 0's gradient all_reduce).
Fix: shard the *windows* with a DistributedSampler (or agree on min steps across ranks with an
all_reduce(MIN), or wrap the loop in `model.join()`), so all ranks run the same number of steps.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): exit code 1 after ~4-6 s.
Rank 0 has 33 batches/epoch, rank 1 21.  Rank 1 finishes epoch 0 ("21 steps") and enters the
validation all_reduce, which receives rank 0's gradient-bucket message: rank 1 aborts (SIGABRT,
exitcode -6) with gloo's "op.preamble.length <= op.nbytes. 11380 vs 8 ... Is there a distributed
collective mismatch in your code?"; rank 0 raises "Connection reset by peer" inside
loss.backward() and is SIGTERMed.  It does not hang with gloo (hence no hang options).
"""
import logging
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": ["uneven_inputs", "collective_mismatch", "hang", "rank_failure"],
    "rank": None,
    "fix": ["join", "sampler", "batches"],
    "options": [],
}

READINGS_PER_DAY = 96
HISTORY, HORIZON = 12, 3
STRIDE = 3
DETECTORS = list(range(12))
# days of usable history per detector (outages / late installation on some of them)
DAYS = {0: 14, 1: 9, 2: 14, 3: 7, 4: 14, 5: 10, 6: 13, 7: 6, 8: 14, 9: 11, 10: 12, 11: 8}
BATCH = 64
EPOCHS = 3
SEED = 5

log = logging.getLogger("traffic")


def detector_series(det, g):
    n = DAYS[det] * READINGS_PER_DAY
    t = torch.arange(n).float()
    tod = (t % READINGS_PER_DAY) / READINGS_PER_DAY
    free_flow = 105.0 - 3.0 * (det % 4)
    am = torch.exp(-((tod - 0.33) / 0.04) ** 2)
    pm = torch.exp(-((tod - 0.72) / 0.05) ** 2)
    weekday = ((t // READINGS_PER_DAY) % 7 < 5).float()
    speed = free_flow - weekday * (35 * am + 40 * pm) * (0.8 + 0.05 * (det % 5))
    speed = speed + 3.0 * torch.randn(n, generator=g)
    return speed, tod


def make_windows(det, g):
    speed, tod = detector_series(det, g)
    xs, ys = [], []
    for s in range(0, len(speed) - HISTORY - HORIZON, STRIDE):
        hist = (speed[s:s + HISTORY] - 80.0) / 20.0
        ang = 2 * math.pi * tod[s:s + HISTORY]
        xs.append(torch.stack([hist, torch.sin(ang), torch.cos(ang)], 1))
        ys.append((speed[s + HISTORY:s + HISTORY + HORIZON] - 80.0) / 20.0)
    x, y = torch.stack(xs), torch.stack(ys)
    return x, y, torch.full((len(x),), det, dtype=torch.long)


class SpeedForecaster(nn.Module):
    def __init__(self, n_det=len(DETECTORS), hidden=48):  # noqa: B008
        super().__init__()
        self.det_emb = nn.Embedding(n_det, 8)
        self.gru = nn.GRU(3 + 8, hidden, batch_first=True)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, HORIZON))

    def forward(self, x, det):
        e = self.det_emb(det).unsqueeze(1).expand(-1, x.size(1), -1)
        out, _ = self.gru(torch.cat([x, e], 2))
        return self.head(out[:, -1])


def split_train_val(x, y, d, frac=0.85):
    cut = int(len(x) * frac)
    return (x[:cut], y[:cut], d[:cut]), (x[cut:], y[cut:], d[cut:])


@torch.no_grad()
def validate(model, loader):
    model.eval()
    se = torch.zeros(HORIZON, dtype=torch.float64)
    n = torch.zeros(1, dtype=torch.float64)
    for x, y, d in loader:
        err = (model.module(x, d) - y) * 20.0
        se += (err ** 2).sum(0).double()
        n += len(y)
    tot = torch.cat([se, n])
    dist.all_reduce(tot)
    model.train()
    return (tot[:HORIZON] / tot[HORIZON]).sqrt()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED)

    my_ids = DETECTORS[rank::world]  # zoo: place
    tr_parts, va_parts = [], []
    for det in my_ids:
        g = torch.Generator().manual_seed(SEED * 1000 + det)
        tr, va = split_train_val(*make_windows(det, g))
        tr_parts.append(tr)
        va_parts.append(va)
    train_ds = TensorDataset(*[torch.cat(p) for p in zip(*tr_parts)])
    val_ds = TensorDataset(*[torch.cat(p) for p in zip(*va_parts)])
    gen = torch.Generator().manual_seed(SEED + rank)
    train_dl = DataLoader(train_ds, batch_size=BATCH, shuffle=True, generator=gen, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=256)
    log.info("detectors %s -> %d train windows, %d batches/epoch", my_ids, len(train_ds),
             len(train_dl))

    model = DDP(SpeedForecaster())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ckpt = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "speed_gru_ho24.pt")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)

    for epoch in range(EPOCHS):
        t0, tot, nb = time.time(), 0.0, 0
        for x, y, d in train_dl:
            loss = F.smooth_l1_loss(model(x, d), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            tot += loss.item()
            nb += 1
        sched.step()
        log.info("epoch %d: %d steps, train loss %.4f (%.1fs)", epoch, nb, tot / nb,
                 time.time() - t0)
        rmse = validate(model, val_dl)
        if rank == 0:
            log.info("epoch %d val RMSE km/h: %s", epoch, ", ".join(f"{v:.2f}" for v in rmse))
            torch.save({"epoch": epoch, "model": model.module.state_dict()}, ckpt)

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] param checksum {checksum:.10f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
