"""Field-level crop yield regression (t/ha) from a season of weekly NDVI, rainfall and
growing-degree-days plus static soil features, trained with DDP (gloo, CPU).

What the job does
    4096 synthetic fields (deterministic seed) with a 20-week time series each.  A GRU
    encoder over the weekly series plus a small MLP on soil features predicts yield.
    The training set is sharded with DistributedSampler(shuffle=True); the validation
    set with DistributedSampler(shuffle=False) and evaluated on all ranks through
    model.module under no_grad, metrics all-reduced.  6 epochs; rank 0 logs and saves.

Root cause
    The epoch loop never calls train_sampler.set_epoch(epoch).  DistributedSampler
    seeds its shuffle with seed + epoch, and its epoch stays 0, so every epoch every
    rank replays exactly the same permutation of its shard (same batches, same order)
    - the shuffle only happens once.  Nothing fails; the job exits 0.

Fix
    Call train_sampler.set_epoch(epoch) at the start of every epoch, before iterating
    the DataLoader.

Observed (plain run: OMP_NUM_THREADS=1 timeout 90 torchrun --standalone --nproc_per_node 2)
    Exit code 0 in ~6-10 s, no warning.  Prints one line per epoch, from
    "epoch 0: train huber 4.2890  val RMSE 1.810 t/ha" to
    "epoch 5: train huber 0.3381  val RMSE 0.875 t/ha".  Replicas identical at the
    end.  The symptom is silent: DistributedSampler(seed=31337) with its epoch
    left at 0 yields exactly the same index list on every pass (checked directly:
    list(sampler) is identical on consecutive passes, and differs after
    set_epoch(1)).
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

EXPECT = {
    "kind": ["missing_set_epoch"],
    "rank": None,
    "fix": ["set_epoch"],
    "options": [],
}

SEED = 31337
N_FIELDS = 4096
N_VAL = 512
WEEKS = 20
N_SOIL = 6
BATCH = 64
EPOCHS = 6
OUT_DIR = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "crop_yield")


def simulate_season(n, seed):
    g = torch.Generator().manual_seed(seed)
    soil = torch.rand(n, N_SOIL, generator=g)                       # clay, sand, OM, pH, N, P (scaled)
    sowing = torch.randint(0, 4, (n,), generator=g).float()
    weeks = torch.arange(WEEKS).float()
    peak = 10 + sowing[:, None] + 2 * torch.randn(n, 1, generator=g)
    vigour = 0.4 + 0.4 * soil[:, 2:3] + 0.1 * torch.randn(n, 1, generator=g)
    ndvi = 0.15 + vigour * torch.exp(-((weeks - peak) / 4.0) ** 2) + 0.02 * torch.randn(n, WEEKS, generator=g)
    rain = torch.relu(20 + 15 * torch.randn(n, WEEKS, generator=g))
    gdd = torch.cumsum(8 + 3 * torch.rand(n, WEEKS, generator=g), dim=1)
    series = torch.stack([ndvi, rain / 50.0, gdd / 200.0], dim=-1)  # n, WEEKS, 3
    stress = torch.relu(15 - rain[:, 8:14].mean(1)) / 15.0
    yld = 2.0 + 8.0 * ndvi.max(1).values + 1.5 * soil[:, 4] - 2.5 * stress + 0.3 * torch.randn(n, generator=g)
    return series, soil, yld


class YieldModel(nn.Module):
    def __init__(self, hidden=48):
        super().__init__()
        self.gru = nn.GRU(3, hidden, batch_first=True)
        self.soil = nn.Sequential(nn.Linear(N_SOIL, 16), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(hidden + 16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, series, soil):
        _, h = self.gru(series)
        return self.head(torch.cat([h[-1], self.soil(soil)], dim=1)).squeeze(-1)


@torch.no_grad()
def evaluate(net, loader):
    net.eval()
    sq, n = torch.zeros((), dtype=torch.float64), 0
    for series, soil, y in loader:
        sq += F.mse_loss(net(series, soil), y, reduction="sum").double()
        n += len(y)
    stats = torch.stack([sq, torch.tensor(float(n), dtype=torch.float64)])
    dist.all_reduce(stats)
    net.train()
    return (stats[0] / stats[1]).sqrt().item()


def train_one_epoch(model, loader, opt, epoch):
    total, n = 0.0, 0
    for series, soil, y in loader:
        pred = model(series, soil)
        loss = F.smooth_l1_loss(pred, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        total += loss.item()
        n += 1
    return total / max(n, 1)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)

    series, soil, yld = simulate_season(N_FIELDS + N_VAL, SEED)
    train_ds = TensorDataset(series[:N_FIELDS], soil[:N_FIELDS], yld[:N_FIELDS])
    val_ds = TensorDataset(series[N_FIELDS:], soil[N_FIELDS:], yld[N_FIELDS:])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=SEED)
    train_loader = DataLoader(train_ds, batch_size=BATCH, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False))

    model = DDP(YieldModel())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    for epoch in range(EPOCHS):  # zoo: place
        train_loss = train_one_epoch(model, train_loader, opt, epoch)
        rmse = evaluate(model.module, val_loader)
        if rank == 0:
            print(f"epoch {epoch}: train huber {train_loss:.4f}  val RMSE {rmse:.3f} t/ha", flush=True)

    if rank == 0:
        os.makedirs(OUT_DIR, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(OUT_DIR, "yield_gru.pt"))
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
