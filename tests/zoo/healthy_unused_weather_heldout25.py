"""Precipitation nowcasting with an optional radar branch and find_unused_parameters (2-rank DDP, gloo/CPU).

What the job does
-----------------
Weather-station observations (temperature, dew point, pressure tendency, wind, cloud
cover...; synthetic, seeded) predict "rain in the next hour".  Batches are grouped by
region; only some regions have weather-radar coverage, and for those batches an extra
small CNN encodes an 8x8 radar reflectivity patch.  When a batch has no radar the model
feeds zeros to the fusion head instead, so the radar encoder's parameters get no
gradient in that step.  Which rank gets a radar batch in a given step is data-dependent
and often differs between ranks.  The model is wrapped with
`DDP(..., find_unused_parameters=True)` and trained with Adam.

Why it is healthy
-----------------
`find_unused_parameters=True` lets DDP's reducer mark the radar encoder's parameters as
ready when they were not used locally, so every rank launches the same bucket
all-reduces each step; a parameter used on only one rank receives that rank's gradient
averaged with zero, and both replicas apply the same update.  Replica weights are
compared at the end.  (Looks suspicious: data-dependent branch, unused parameters,
rank-varying control flow.)

Observed (plain run, torchrun --nproc_per_node 2, OMP_NUM_THREADS=1)
--------------------------------------------------------------------
exit 0 after ~6-8 s, 8 epochs x 60 steps; radar batches per epoch differ between ranks
(e.g. epoch 7: rank 0 21/60, rank 1 14/60).  Last lines:
    rank0 epoch 7 loss 0.3600 acc 0.837 (radar batches 21/60)
    rank0 replica 0: param sum 81.31116317 sq 99.01067675
    rank0 replica 1: param sum 81.31116317 sq 99.01067675
    rank0 replicas identical: True
"""
import gc
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None

N_STATION_FEATS = 10
RADAR = 8
BATCH = 48
EPOCHS = 8
BATCHES_PER_EPOCH = 60


class Nowcaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.station = nn.Sequential(nn.Linear(N_STATION_FEATS, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.radar = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                                   nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 32))
        self.head = nn.Sequential(nn.Linear(64 + 32, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, obs, radar=None):
        h = self.station(obs)
        if radar is not None:  # noqa: SIM108
            r = self.radar(radar)
        else:
            r = h.new_zeros(h.shape[0], 32)
        return self.head(torch.cat([h, r], dim=1)).squeeze(-1)


class RegionBatches:
    """Yields (obs, radar_or_None, rain) batches, one region per batch."""

    def __init__(self, rank, seed=77):
        self.g = torch.Generator().manual_seed(seed + rank)
        self.radar_coverage = 0.45 if rank == 0 else 0.3

    def batch(self):
        g = self.g
        has_radar = bool(torch.rand(1, generator=g) < self.radar_coverage)
        obs = torch.randn(BATCH, N_STATION_FEATS, generator=g)
        humidity, p_tend, cloud = obs[:, 1], obs[:, 2], obs[:, 5]
        storm_y, storm_x = torch.randint(0, RADAR, (2,), generator=g)
        yy, xx = torch.meshgrid(torch.arange(RADAR), torch.arange(RADAR), indexing="ij")
        cell = torch.exp(-((yy - storm_y) ** 2 + (xx - storm_x) ** 2).float() / 6.0)
        intensity = F.softplus(0.8 * humidity - 0.9 * p_tend + 0.5 * cloud + 0.3 * torch.randn(BATCH, generator=g))
        radar = intensity[:, None, None, None] * cell + 0.1 * torch.randn(BATCH, 1, RADAR, RADAR, generator=g)
        rain = (intensity + 0.4 * torch.randn(BATCH, generator=g) > 1.0).float()
        return obs, (radar if has_radar else None), rain


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(message)s")
    log = logging.getLogger("nowcast")

    torch.manual_seed(0)
    model = DDP(Nowcaster(), find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    source = RegionBatches(rank)

    for epoch in range(EPOCHS):
        n_radar, tot, hits, n = 0, 0.0, 0, 0
        for step in range(BATCHES_PER_EPOCH):  # noqa: B007
            obs, radar, rain = source.batch()
            logits = model(obs, radar)
            loss = F.binary_cross_entropy_with_logits(logits, rain)
            opt.zero_grad()
            loss.backward()
            opt.step()
            n_radar += radar is not None
            tot += loss.item()
            hits += ((logits > 0).float() == rain).sum().item()
            n += rain.numel()
        log.info("epoch %d loss %.4f acc %.3f (radar batches %d/%d)", epoch, tot / BATCHES_PER_EPOCH,
                 hits / n, n_radar, BATCHES_PER_EPOCH)

    flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]).double()
    mine = torch.stack([flat.sum(), (flat * flat).sum()])
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        for r, v in enumerate(every):
            log.info("replica %d: param sum %.8f sq %.8f", r, v[0].item(), v[1].item())
        log.info("replicas identical: %s", all(torch.equal(every[0], v) for v in every))
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
