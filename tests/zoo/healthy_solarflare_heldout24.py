"""Solar-flare forecasting (>= M-class within 24 h) from active-region magnetic parameters, DDP.

Story
-----
For every solar active region the job sees 24 hourly samples of 10 SHARP-like magnetic-field
parameters (total unsigned flux, current helicity, free-energy proxy, polarity-inversion-line
length, ...) and predicts whether the region produces an M- or X-class flare in the next 24 h.
Model: dilated temporal convolutions + attention pooling + MLP head.  The positive class is
rare, so the loss uses a positive-class weight recomputed every epoch from the global counts.

Why it looks suspicious but is healthy
--------------------------------------
* `refresh_pos_weight()` calls all_reduce and is reached through a data-dependent `if`; but the
  condition it depends on (`global_pos`) is itself an all_reduced value, so every rank takes the
  same branch and calls the same collectives in the same order.
* Only rank 0 logs, decides early stopping and writes checkpoints; the decision is shared with
  `dist.broadcast(stop, src=0)` which *every* rank calls, and all ranks meet at a barrier after
  the checkpoint is written.
* Each rank uses a rank-dependent seed for its jitter augmentation - that only changes the data,
  never the weights, which DDP keeps identical.
Expected: exits 0, both ranks print the same parameter checksum.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): exit code 0 in ~7.5-10 s,
4 epochs, val TSS ~0.86, parameter checksum 112.3116914646 on both ranks.
"""
import logging
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

FEATURES = ["USFLUX", "MEANGAM", "MEANGBT", "MEANJZH", "TOTUSJH", "TOTUSJZ", "ABSNJZH",
            "SAVNCPP", "TOTPOT", "R_VALUE"]
HOURS = 24
N_REGIONS = 3000
EPOCHS = 4
PATIENCE = 3
BATCH = 64
SEED = 11

log = logging.getLogger("flare")


def synth_regions(n, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 1, len(FEATURES), generator=g)
    trend = 0.05 * torch.randn(n, 1, len(FEATURES), generator=g)
    t = torch.arange(HOURS).float().view(1, HOURS, 1)
    x = base + trend * t + 0.3 * torch.randn(n, HOURS, len(FEATURES), generator=g)
    energy = x[:, -6:, 8].mean(1) + 0.8 * x[:, -6:, 9].mean(1) + 6 * trend[:, 0, 4]
    y = (energy + 0.4 * torch.randn(n, generator=g) > 1.9).float()
    return x, y


class TemporalBlock(nn.Module):
    def __init__(self, ch, dilation):
        super().__init__()
        self.conv = nn.Conv1d(ch, ch, 3, padding=dilation, dilation=dilation)
        self.norm = nn.BatchNorm1d(ch)

    def forward(self, x):
        return x + F.relu(self.norm(self.conv(x)))


class FlareNet(nn.Module):
    def __init__(self, ch=32):
        super().__init__()
        self.inp = nn.Conv1d(len(FEATURES), ch, 1)
        self.tcn = nn.Sequential(*[TemporalBlock(ch, d) for d in (1, 2, 4, 8)])
        self.attn = nn.Conv1d(ch, 1, 1)
        self.head = nn.Sequential(nn.Linear(ch, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))

    def forward(self, x):                       # x: (B, T, F)
        h = self.tcn(self.inp(x.transpose(1, 2)))
        w = torch.softmax(self.attn(h), dim=-1)
        return self.head((h * w).sum(-1)).squeeze(1)


def refresh_pos_weight(local_y, current):
    """Recompute the positive-class weight from the *global* label counts."""
    counts = torch.tensor([local_y.sum().item(), float(len(local_y))])
    dist.all_reduce(counts)
    global_pos, global_n = counts.tolist()
    if global_pos > 0:                 # same value on every rank -> same branch everywhere
        ratio = torch.tensor([(global_n - global_pos) / global_pos])
        dist.all_reduce(ratio)         # average of identical values: a cheap consistency check
        return (ratio / dist.get_world_size()).clamp(max=20.0)
    return current


@torch.no_grad()
def true_skill_statistic(model, loader):
    model.eval()
    conf = torch.zeros(4)  # tp, fp, fn, tn
    for x, y in loader:
        p = (torch.sigmoid(model(x)) > 0.5).float()
        conf += torch.stack([(p * y).sum(), (p * (1 - y)).sum(), ((1 - p) * y).sum(),
                             ((1 - p) * (1 - y)).sum()])
    dist.all_reduce(conf)
    model.train()
    tp, fp, fn, tn = conf.tolist()
    return tp / max(tp + fn, 1) - fp / max(fp + tn, 1)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()  # noqa: F841
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED)

    x, y = synth_regions(N_REGIONS, SEED)
    mu, sd = x.mean((0, 1)), x.std((0, 1))
    x = (x - mu) / sd
    n_val = 600
    train_ds, val_ds = TensorDataset(x[n_val:], y[n_val:]), TensorDataset(x[:n_val], y[:n_val])
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=SEED, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=BATCH, sampler=tr_sampler)
    val_dl = DataLoader(val_ds, batch_size=200, sampler=va_sampler)

    model = DDP(FlareNet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    jitter = torch.Generator().manual_seed(SEED + 1000 * rank)
    pos_weight = torch.tensor([1.0])
    ckpt_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "flarenet_ho24")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    best, bad_epochs = -1.0, 0

    for epoch in range(EPOCHS):
        tr_sampler.set_epoch(epoch)
        shard_labels = y[n_val:][list(iter(tr_sampler))]
        pos_weight = refresh_pos_weight(shard_labels, pos_weight)
        t0, tot = time.time(), 0.0
        for xb, yb in train_dl:
            xb = xb + 0.05 * torch.randn(xb.shape, generator=jitter)
            loss = F.binary_cross_entropy_with_logits(model(xb), yb, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item()
        tss = true_skill_statistic(model, val_dl)

        stop = torch.zeros(1)
        if rank == 0:
            log.info("epoch %d loss %.4f pos_weight %.2f val TSS %.3f (%.1fs)", epoch,
                     tot / len(train_dl), pos_weight.item(), tss, time.time() - t0)
            if tss > best:
                best, bad_epochs = tss, 0
                torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "best.pt"))
            else:
                bad_epochs += 1
            stop[0] = float(bad_epochs >= PATIENCE)
        dist.broadcast(stop, src=0)
        dist.barrier()
        if stop.item():
            log.info("early stopping at epoch %d", epoch)
            break

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] param checksum {checksum:.10f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
