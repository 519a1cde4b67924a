"""Next-day wildfire ignition risk per grid cell with a drought correction, 2-rank CPU DDP.

Scored as a healthy twin (it was written as a pathology): find_unused_parameters=True is how DDP
is meant to carry a parameter that a data-dependent branch uses on some steps; the job pays the
graph walk and loses nothing else. The doctor's `info` finding says which parameter and on how
many steps; a warning here would be a false alarm.

What the job does
    Trains a small residual MLP on synthetic grid-cell weather/fuel features
    (temperature, relative humidity, wind, dead-fuel moisture, days since
    rain, slope, vegetation index, road density) to classify whether a fire
    ignites the next day. Cells in drought (fuel moisture below
    cfg.drought_moisture) get an extra learned per-feature correction,
    ``self.drought_scale`` (a raw nn.Parameter), applied to the embedded
    features.

Root cause
    The correction is applied only when the *batch* contains at least one
    drought cell: ``if bool((fuel_moisture < thr).any()):``. Drought cells are
    rare (~3% of cells), so on many steps no rank's batch has one and
    drought_scale takes no part in the loss. The author hit DDP's
    "Expected to have finished reduction" error and silenced it with
    find_unused_parameters=True, so the job finishes, but drought_scale gets
    no gradient on a large fraction of steps (and pays the unused-parameter
    graph traversal every step).

Fix
    Apply the correction unconditionally with a per-sample mask, e.g.
    ``emb = emb * (1 + drought_mask[:, None] * self.drought_scale)``; then
    drought_scale receives a (possibly zero) gradient every step and
    find_unused_parameters=True can be dropped.

What a plain run shows
    torchrun ... --nproc_per_node 2 exits 0 after ~5 s wall, no error:
    187 steps, loss falls (bce ~2.2 -> ~0.5), final line
    "done: 187 steps in ~1s, |drought_scale|=0.0092". Silently, on 69 of the
    187 steps (~37%) neither rank had a drought cell, so drought_scale took no
    part in the loss and its .grad stayed None after backward (measured with an
    instrumented copy; identical on both ranks). Both ranks are affected alike.
    The only warning is PyTorch's reducer note on step 0 (both ranks):
    "find_unused_parameters=True was specified in DDP constructor, but did not
    find any unused parameters in the forward pass" -- step 0 happens to have
    drought cells; the note itself says it may be a false positive with flow
    control, and turning the flag off would crash on the later steps.
"""
import gc
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = None

FEATURES = ["temp_c", "rel_humidity", "wind_ms", "fuel_moisture", "days_since_rain",
            "slope_deg", "ndvi", "road_density"]
FUEL_MOISTURE = FEATURES.index("fuel_moisture")


@dataclass
class FireConfig:
    num_cells: int = 6000
    hidden: int = 64
    blocks: int = 2
    batch_size: int = 16
    epochs: int = 1
    lr: float = 1e-3
    drought_moisture: float = 0.06  # fraction; below this the cell counts as in drought
    pos_weight: float = 6.0
    seed: int = 31
    out_dir: str = field(
        default_factory=lambda: os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "wildfire_risk")
    )


class GridCellDataset(Dataset):
    """Synthetic daily observations for grid cells; label = ignition next day."""

    def __init__(self, cfg: FireConfig):
        g = torch.Generator().manual_seed(cfg.seed)
        n = cfg.num_cells
        temp = 10 + 25 * torch.rand(n, generator=g)
        rh = 0.1 + 0.8 * torch.rand(n, generator=g)
        wind = 12 * torch.rand(n, generator=g) ** 1.5
        fuel = 0.05 + 0.25 * torch.rand(n, generator=g) ** 0.7
        fuel[torch.rand(n, generator=g) < 0.02] = 0.03  # a few cured-fuel drought cells
        dry_days = torch.randint(0, 40, (n,), generator=g).float()
        slope = 35 * torch.rand(n, generator=g)
        ndvi = torch.rand(n, generator=g)
        roads = torch.rand(n, generator=g)
        logit = (0.08 * (temp - 25) - 3.0 * rh + 0.25 * wind - 12 * (fuel - 0.12)
                 + 0.03 * dry_days + 1.5 * roads - 2.0)
        self.y = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
        self.x = torch.stack([temp, rh, wind, fuel, dry_days, slope, ndvi, roads], dim=1)
        self.mean, self.std = self.x.mean(0), self.x.std(0)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, idx):
        return self.x[idx], self.y[idx]


class ResidualBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class FireRiskNet(nn.Module):
    def __init__(self, cfg: FireConfig, mean, std):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.embed = nn.Linear(len(FEATURES), cfg.hidden)
        self.drought_scale = nn.Parameter(torch.zeros(cfg.hidden))
        self.blocks = nn.Sequential(*[ResidualBlock(cfg.hidden) for _ in range(cfg.blocks)])
        self.out = nn.Linear(cfg.hidden, 1)

    def forward(self, x):
        fuel_moisture = x[:, FUEL_MOISTURE]
        emb = self.embed((x - self.mean) / self.std)
        if bool((fuel_moisture < self.cfg.drought_moisture).any()):
            drought = (fuel_moisture < self.cfg.drought_moisture).float().unsqueeze(1)
            emb = emb * (1 + drought * self.drought_scale)
        return self.out(self.blocks(emb)).squeeze(-1)


def brier_and_hit_rate(logits, y):
    p = torch.sigmoid(logits)
    brier = ((p - y) ** 2).mean().item()
    hit = ((p > 0.5).float() == y).float().mean().item()
    return brier, hit


def main():
    cfg = FireConfig()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)

    dataset = GridCellDataset(cfg)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)

    net = FireRiskNet(cfg, dataset.mean, dataset.std)
    # find_unused_parameters=True: without it DDP errors out on batches with no drought cells.
    model = DDP(net, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-3)
    pos_weight = torch.tensor(cfg.pos_weight)

    step, t0 = 0, time.time()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and step % 40 == 0:
                brier, hit = brier_and_hit_rate(logits.detach(), y)
                print(f"epoch {epoch} step {step} bce {loss.item():.4f} brier {brier:.3f} "
                      f"acc {hit:.2f}", flush=True)
            step += 1

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "fire_risk.pt"))
        print(f"done: {step} steps in {time.time() - t0:.1f}s, "
              f"|drought_scale|={net.drought_scale.abs().mean().item():.4f}", flush=True)
    dist.barrier()  # let rank 0 finish writing before tearing down gloo
    del model, optimizer  # drop DDP (and its handle on the gloo group) before teardown
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
