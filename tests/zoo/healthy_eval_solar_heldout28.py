"""Photovoltaic power nowcasting: predict the next hour of PV output (4 x 15 min) of a
solar plant from the previous 6 h of irradiance, panel temperature, cloud index and
output, trained with DDP (gloo, CPU).

What the job does
    A deterministic synthetic plant history (clear-sky curve x cloud attenuation) is cut
    into 24-step windows.  A temporal-conv + MLP forecaster is trained with
    DistributedSampler + set_epoch for 3 epochs.  Every VAL_EVERY steps *every* rank
    evaluates its shard of the validation windows (DistributedSampler, shuffle=False)
    through model.module under torch.no_grad(), and the error sums are all-reduced so
    rank 0 can print the global MAE.  At the end of each epoch rank 0 writes
    model.module.state_dict() to $TMPDIR/ddpdoctor-zoo/solar_nowcast/, and all ranks
    then meet at dist.barrier(); after training every rank reloads the last
    checkpoint with map_location="cpu" to check the saved weights against its replica.

Healthy: why it is correct
    Evaluation is periodic but shared: all ranks evaluate equal-sized shards at the
    same step and all reach the same all_reduce, so no rank waits for another's
    private work.  It uses model.module under no_grad, so no DDP forward-time
    collectives or autograd state are involved.  Checkpointing is rank-0-only and
    small, followed by a barrier that every rank reaches; the model has no buffers
    (LayerNorm, no BatchNorm) so the replicas stay identical.

Fix
    None needed.

Observed (plain run: OMP_NUM_THREADS=1 timeout 90 torchrun --standalone --nproc_per_node 2)
    Exit code 0 in ~5-9 s (9 runs), no warnings.  Rank 0 prints validation every 20
    steps ("epoch 0 step 20 train mse 0.00584 val MAE 0.0750" ...
    "epoch 2 step 100 train mse 0.00244 val MAE 0.0410"), then both ranks print
    "checkpoint matches replica: True".  Parameters identical across ranks at the
    end; time in data loading and backward equal on both ranks.
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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

SEED = 2718
STEPS_PER_DAY = 96                      # 15-minute resolution
N_DAYS = 120
LOOKBACK, HORIZON = 24, 4
N_FEATURES = 4
BATCH = 64
EPOCHS = 3
VAL_EVERY = 20
CKPT_DIR = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "solar_nowcast")


def simulate_plant(seed):
    g = torch.Generator().manual_seed(seed)
    n = STEPS_PER_DAY * N_DAYS
    t = torch.arange(n, dtype=torch.float32)
    hour = (t % STEPS_PER_DAY) / 4.0
    day = t // STEPS_PER_DAY
    season = 0.8 + 0.2 * torch.cos(2 * math.pi * (day - 172) / 365.0)
    clear_sky = torch.clamp(torch.sin(math.pi * (hour - 6.0) / 13.0), min=0.0) * season
    # AR(1) cloud index in [0, 1]
    noise = torch.randn(n, generator=g)
    cloud = torch.zeros(n)
    for i in range(1, n):
        cloud[i] = 0.97 * cloud[i - 1] + 0.08 * noise[i]
    cloud = torch.sigmoid(3 * cloud - 1)
    irradiance = clear_sky * (1 - 0.75 * cloud)
    temp = 15 + 20 * irradiance + 2 * torch.randn(n, generator=g)
    power = irradiance * (1 - 0.004 * (temp - 25)) + 0.01 * torch.randn(n, generator=g)
    feats = torch.stack([irradiance, (temp - 25) / 10, cloud, power], dim=1)
    return feats, power


def make_windows(feats, power, start, stop):
    xs, ys = [], []
    for s in range(start, stop - LOOKBACK - HORIZON, 2):
        xs.append(feats[s:s + LOOKBACK])
        ys.append(power[s + LOOKBACK:s + LOOKBACK + HORIZON])
    return TensorDataset(torch.stack(xs), torch.stack(ys))


class Nowcaster(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.tconv = nn.Sequential(
            nn.Conv1d(N_FEATURES, 32, 5, padding=2), nn.GELU(),
            nn.Conv1d(32, 32, 5, padding=2, dilation=1), nn.GELU(),
        )
        self.norm = nn.LayerNorm(32 * LOOKBACK)
        self.mlp = nn.Sequential(nn.Linear(32 * LOOKBACK, hidden), nn.GELU(), nn.Linear(hidden, HORIZON))

    def forward(self, x):                        # x: B, T, F
        h = self.tconv(x.transpose(1, 2)).flatten(1)
        return self.mlp(self.norm(h))


@torch.no_grad()
def evaluate(net, loader):
    net.eval()
    err = torch.zeros(2, dtype=torch.float64)
    for x, y in loader:
        err[0] += (net(x) - y).abs().sum().double()
        err[1] += y.numel()
    dist.all_reduce(err)
    net.train()
    return (err[0] / err[1]).item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)

    feats, power = simulate_plant(SEED)
    split = STEPS_PER_DAY * 100
    train_ds = make_windows(feats, power, 0, split)
    val_ds = make_windows(feats, power, split, len(power))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=SEED)
    train_loader = DataLoader(train_ds, batch_size=BATCH, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False))

    model = DDP(Nowcaster())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    ckpt_path = os.path.join(CKPT_DIR, "nowcaster.pt")

    step = 0
    for epoch in range(EPOCHS):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % VAL_EVERY == 0:
                mae = evaluate(model.module, val_loader)
                if rank == 0:
                    print(f"epoch {epoch} step {step} train mse {loss.item():.5f} val MAE {mae:.4f}", flush=True)
        if rank == 0:
            os.makedirs(CKPT_DIR, exist_ok=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict()}, ckpt_path)
        dist.barrier()

    saved = torch.load(ckpt_path, map_location="cpu")["model"]
    same = all(torch.equal(saved[k], v) for k, v in model.module.state_dict().items())
    print(f"rank {rank}: checkpoint matches replica: {same}", flush=True)
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
