"""Exoplanet transit detection: binary classification of phase-folded stellar light
curves (transit / no transit, with eclipsing-binary and spot-modulation impostors),
trained with DDP (gloo, CPU).

What the job does
    3072 deterministic synthetic light curves of 256 flux samples (box-shaped transits
    of random depth/duration, stellar variability, white noise; negatives include
    V-shaped eclipsing binaries).  A 1-D CNN is trained for 5 epochs.  The training
    set is sharded with DistributedSampler(shuffle=True) and the loop calls
    sampler.set_epoch(epoch) at the start of every epoch; at the end every rank
    evaluates its shard of the held-out curves (DistributedSampler, shuffle=False)
    through model.module under no_grad and the counts are all-reduced.  Rank 0 saves
    model.module.state_dict(), then all ranks meet at a barrier.

Healthy: why it is correct
    Each rank reads a disjoint shard, and set_epoch() gives every epoch a fresh
    permutation that all ranks agree on.  Evaluation runs on every rank over equal
    shards and ends in one all_reduce that everyone reaches; checkpointing is
    rank-0-only followed by a barrier every rank reaches.  No BatchNorm, so there are
    no buffers to drift.

Fix
    None needed.

Observed (plain run: OMP_NUM_THREADS=1 timeout 90 torchrun --standalone --nproc_per_node 2)
    Exit code 0 in ~8-10 s (4 runs), no warnings.  "epoch 0: train bce 0.8425" ...
    "epoch 4: train bce 0.1793", "test precision 0.892 recall 0.943".  Parameters
    identical across ranks at the end; equal data/backward time on both ranks.
"""
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

SEED = 1995
N_CURVES = 3072
N_TEST = 512
N_BINS = 256
BATCH = 64
EPOCHS = 5
OUT_DIR = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "transit_cnn")


def simulate_light_curves(n, seed):
    g = torch.Generator().manual_seed(seed)
    phase = torch.linspace(-0.5, 0.5, N_BINS)
    kind = torch.randint(0, 3, (n,), generator=g)         # 0 planet, 1 eclipsing binary, 2 quiet/spotted star
    depth = 10 ** (-3 + 1.3 * torch.rand(n, generator=g))
    width = 0.02 + 0.06 * torch.rand(n, generator=g)
    spot_amp = 0.002 * torch.rand(n, generator=g)
    spot_per = 0.3 + 0.7 * torch.rand(n, generator=g)
    spot_ph = 6.283 * torch.rand(n, generator=g)
    flux = 1.0 + spot_amp[:, None] * torch.sin(6.283 * phase[None] / spot_per[:, None] + spot_ph[:, None])
    d = phase[None].abs() / width[:, None]
    box = (d < 0.5).float()
    vee = torch.clamp(1 - d, min=0.0)
    flux = flux - (kind == 0).float()[:, None] * depth[:, None] * box
    flux = flux - (kind == 1).float()[:, None] * 3 * depth[:, None] * vee
    flux = flux + 0.0007 * torch.randn(n, N_BINS, generator=g)
    norm = (flux - flux.median(dim=1, keepdim=True).values) / flux.std(dim=1, keepdim=True)
    return norm[:, None], (kind == 0).float()


class TransitCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


@torch.no_grad()
def evaluate(net, loader):
    net.eval()
    counts = torch.zeros(3, dtype=torch.float64)      # tp, predicted positives, actual positives
    for x, y in loader:
        pred = (net(x) > 0).float()
        counts += torch.tensor([(pred * y).sum(), pred.sum(), y.sum()], dtype=torch.float64)
    dist.all_reduce(counts)
    net.train()
    tp, pp, ap = counts.tolist()
    return tp / max(pp, 1.0), tp / max(ap, 1.0)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)

    x, y = simulate_light_curves(N_CURVES + N_TEST, SEED)
    train_ds = TensorDataset(x[:N_CURVES], y[:N_CURVES])
    test_ds = TensorDataset(x[N_CURVES:], y[N_CURVES:])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=SEED)
    loader = DataLoader(train_ds, batch_size=BATCH, sampler=sampler, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=256, sampler=DistributedSampler(test_ds, shuffle=False))

    model = DDP(TransitCNN())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pos_weight = torch.tensor(2.0)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        total, n = 0.0, 0
        for xb, yb in loader:
            loss = F.binary_cross_entropy_with_logits(model(xb), yb, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item()
            n += 1
        if rank == 0:
            print(f"epoch {epoch}: train bce {total / n:.4f}", flush=True)

    precision, recall = evaluate(model.module, test_loader)
    if rank == 0:
        print(f"test precision {precision:.3f} recall {recall:.3f}", flush=True)
        os.makedirs(OUT_DIR, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(OUT_DIR, "transit_cnn.pt"))
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
