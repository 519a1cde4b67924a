"""Spacecraft housekeeping-telemetry anomaly detector (1-D conv autoencoder), trained with DDP.

Story
-----
Eight housekeeping channels of a small satellite (bus voltage, battery current and temperature,
two reaction-wheel speeds, solar-array current, payload temperature, transmitter power) are cut
into 64-sample windows.  A convolutional autoencoder learns to reconstruct nominal telemetry;
windows with a large reconstruction error are flagged.  After each epoch the alarm threshold is
calibrated on held-out nominal data and the detector is scored on windows with injected
anomalies (spikes, stuck sensors, drifts).

Why it looks suspicious but is healthy
--------------------------------------
* Rank 0 alone warm-starts the weights from the previous run's checkpoint (only one process
  touches the file) - but it does so *before* wrapping in DDP, and DDP's constructor broadcasts
  rank 0's parameters to every rank.
* Gradient accumulation uses `model.no_sync()` on 3 of every 4 micro-batches; the 4th runs outside
  `no_sync()` and all-reduces the accumulated gradients before `opt.step()`.
* Each rank adds sensor noise from its own rank-seeded generator (data only).
* Rank 0 does extra work once per epoch (threshold calibration + scoring + checkpoint) while rank
  1 waits at a barrier; this is a short per-epoch pause, not a per-step straggler.
Expected: exits 0, both ranks print the same parameter checksum.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): exit code 0 in ~6-7 s;
anomaly F1 ~0.93-0.96; both ranks print the same parameter checksum (on the first run, without
a checkpoint, and on later runs, where rank 0 logs "warm start from ..." and then the checksums
are still equal).
"""
import contextlib
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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

CHANNELS = ["bus_v", "bat_i", "bat_t", "rw1_rpm", "rw2_rpm", "sa_i", "pl_t", "tx_p"]
WIN = 64
ORBIT = 96          # samples per orbit
MICRO_BATCH = 32
ACCUM = 4
EPOCHS = 3
SEED = 1969

log = logging.getLogger("telemetry")


def synth_telemetry(n_windows, seed):
    g = torch.Generator().manual_seed(seed)
    t0 = torch.randint(0, 10 * ORBIT, (n_windows, 1), generator=g).float()
    t = t0 + torch.arange(WIN).float()
    phase = 2 * math.pi * t / ORBIT
    sun = (torch.sin(phase) > -0.3).float()                      # eclipse / sunlight
    base = torch.stack([
        28.0 + 0.5 * sun, 2.0 * sun - 1.0, 20 + 5 * torch.sin(phase - 0.5),
        3000 + 200 * torch.sin(phase * 2), 2800 + 150 * torch.cos(phase * 2),
        4.0 * sun, 15 + 3 * torch.sin(phase - 1.0), 5.0 + 0.0 * t], 1)
    scale = torch.tensor([0.5, 1.0, 5.0, 200, 150, 2.0, 3.0, 0.5]).view(1, -1, 1)
    offset = torch.tensor([28, 0, 20, 3000, 2800, 2, 15, 5]).view(1, -1, 1)
    x = (base - offset) / scale
    return x + 0.05 * torch.randn(x.shape, generator=g)


def inject_anomalies(x, seed):
    g = torch.Generator().manual_seed(seed)
    x = x.clone()
    y = torch.zeros(len(x))
    for i in range(0, len(x), 4):
        ch = int(torch.randint(0, len(CHANNELS), (1,), generator=g))
        kind = i // 4 % 3
        if kind == 0:
            x[i, ch, 30:33] += 4.0                          # spike
        elif kind == 1:
            x[i, ch, 20:] = x[i, ch, 20]                    # stuck sensor
        else:
            x[i, ch] += torch.linspace(0, 3.0, WIN)         # drift
        y[i] = 1
    return x, y


class ConvAE(nn.Module):
    def __init__(self, c=len(CHANNELS), h=32, z=16):  # noqa: B008
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv1d(c, h, 5, 2, 2), nn.GroupNorm(4, h), nn.GELU(),
            nn.Conv1d(h, h, 5, 2, 2), nn.GroupNorm(4, h), nn.GELU(),
            nn.Conv1d(h, z, 3, 2, 1))
        self.dec = nn.Sequential(
            nn.ConvTranspose1d(z, h, 4, 2, 1), nn.GroupNorm(4, h), nn.GELU(),
            nn.ConvTranspose1d(h, h, 4, 2, 1), nn.GroupNorm(4, h), nn.GELU(),
            nn.ConvTranspose1d(h, c, 4, 2, 1))

    def forward(self, x):
        return self.dec(self.enc(x))


@torch.no_grad()
def window_errors(net, x):
    net.eval()
    err = ((net(x) - x) ** 2).mean((1, 2))
    net.train()
    return err


def calibrate_and_score(net, nominal, test_x, test_y):
    thr = torch.quantile(window_errors(net, nominal), 0.99)
    pred = (window_errors(net, test_x) > thr).float()
    tp = (pred * test_y).sum()
    prec = tp / pred.sum().clamp(min=1)
    rec = tp / test_y.sum()
    return thr.item(), (2 * prec * rec / (prec + rec).clamp(min=1e-9)).item()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()  # noqa: F841
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED + rank)          # rank-dependent init on purpose: DDP syncs it

    ckpt = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "telemetry_ae_ho24.pt")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)
    net = ConvAE()
    if rank == 0 and os.path.exists(ckpt):
        net.load_state_dict(torch.load(ckpt, weights_only=True)["model"])
        log.info("warm start from %s", ckpt)
    model = DDP(net)                          # broadcasts rank 0's weights to all ranks

    train = synth_telemetry(4096, SEED)
    ds = TensorDataset(train)
    sampler = DistributedSampler(ds, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(ds, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True)
    if rank == 0:
        nominal = synth_telemetry(512, SEED + 1)
        test_x, test_y = inject_anomalies(synth_telemetry(512, SEED + 2), SEED + 3)

    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    noise = torch.Generator().manual_seed(SEED + 100 * rank)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        t0, tot = time.time(), 0.0
        opt.zero_grad(set_to_none=True)
        for micro, (xb,) in enumerate(loader):
            last_micro = (micro + 1) % ACCUM == 0
            noisy = xb + 0.03 * torch.randn(xb.shape, generator=noise)
            with contextlib.nullcontext() if last_micro else model.no_sync():
                loss = F.mse_loss(model(noisy), xb) / ACCUM
                loss.backward()
            tot += loss.item()
            if last_micro:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        if rank == 0:
            thr, f1 = calibrate_and_score(model.module, nominal, test_x, test_y)
            log.info("epoch %d recon %.5f threshold %.4f anomaly F1 %.3f (%.1fs)", epoch,
                     tot * ACCUM / len(loader), thr, f1, time.time() - t0)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "threshold": thr},
                       ckpt)
        dist.barrier()

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] param checksum {checksum:.10f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
