"""Container-shipping ETA regression with a serving-time quantile head, 2-rank CPU DDP.

What the job does
    Trains an MLP on synthetic voyage features (great-circle distance, port
    congestion, vessel speed, season, carrier embedding) to predict log transit
    hours. For the ops dashboard the model also has ``interval_head`` that
    turns the shared features into P10/P90 offsets, used by
    ``EtaModel.predict_interval()`` when the model is served.

Root cause
    ``interval_head`` is created in __init__ but only used in
    predict_interval(); forward() never touches it. The model is trained
    through DDP with find_unused_parameters=False, so interval_head's
    parameters never get a gradient and DDP's reducer never finishes the
    reduction; the second training forward raises "Expected to have finished
    reduction in the prior iteration before starting a new one". (Even with
    find_unused_parameters=True the head would stay at its random
    initialisation, so the served intervals would be garbage.)

Fix
    Train the interval head: compute it in forward and add a pinball
    (quantile) loss for P10/P90, or keep the head outside the DDP-wrapped
    module / fit it after training. find_unused_parameters=True silences the
    error but leaves the head untrained.

What a plain run shows
    torchrun ... --nproc_per_node 2 exits 1 (ChildFailedError) after ~5-7 s wall.
    Step 0 trains and logs; on step 1 BOTH ranks raise from DDP._pre_forward
    at `pred = model(x_num, x_car)`: "RuntimeError: Expected to have finished
    reduction in the prior iteration before starting a new one. ..." with
    "Parameter indices which did not receive grad for rank N: 7 8"
    (interval_head weight+bias). evaluate()/predict_interval() is never
    reached. Both ranks fail at the same step; torchrun's
    "Root Cause (first observed failure)" names whichever exited first
    (rank 0 in most runs, rank 1 in some).
"""
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": ["unused_parameters"],
    "rank": None,
    "fix": ["find_unused_parameters", "interval_head", "predict_interval"],
    "options": [],
}


@dataclass
class EtaConfig:
    num_voyages: int = 4096
    num_carriers: int = 12
    carrier_dim: int = 8
    num_numeric: int = 6
    hidden: int = 64
    batch_size: int = 64
    epochs: int = 2
    lr: float = 2e-3
    quantiles: tuple = (0.1, 0.9)
    seed: int = 99
    out_dir: str = field(
        default_factory=lambda: os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "shipping_eta")
    )


def synth_voyages(cfg: EtaConfig):
    g = torch.Generator().manual_seed(cfg.seed)
    n = cfg.num_voyages
    distance_nm = 500 + 9000 * torch.rand(n, generator=g)
    speed_kn = 12 + 8 * torch.rand(n, generator=g)
    congestion = torch.rand(n, generator=g) ** 2  # destination port queue index
    month = torch.randint(0, 12, (n,), generator=g).float()
    canal = (torch.rand(n, generator=g) < 0.3).float()
    carrier = torch.randint(0, cfg.num_carriers, (n,), generator=g)
    carrier_delay = torch.linspace(-6, 18, cfg.num_carriers)[carrier]
    hours = distance_nm / speed_kn + 72 * congestion + 30 * canal + carrier_delay
    hours = hours * (1 + 0.08 * torch.randn(n, generator=g)) + 10 * torch.sin(month / 12 * 6.283)
    numeric = torch.stack([
        distance_nm / 10000, speed_kn / 20, congestion, torch.sin(month / 12 * 6.283),
        torch.cos(month / 12 * 6.283), canal,
    ], dim=1)
    return numeric, carrier, torch.log(hours.clamp(min=24.0))


class EtaModel(nn.Module):
    def __init__(self, cfg: EtaConfig):
        super().__init__()
        self.carrier_emb = nn.Embedding(cfg.num_carriers, cfg.carrier_dim)
        self.trunk = nn.Sequential(
            nn.Linear(cfg.num_numeric + cfg.carrier_dim, cfg.hidden), nn.SiLU(),
            nn.Linear(cfg.hidden, cfg.hidden), nn.SiLU(),
        )
        self.point_head = nn.Linear(cfg.hidden, 1)
        self.interval_head = nn.Linear(cfg.hidden, len(cfg.quantiles))

    def features(self, numeric, carrier):
        return self.trunk(torch.cat([numeric, self.carrier_emb(carrier)], dim=1))

    def forward(self, numeric, carrier):
        return self.point_head(self.features(numeric, carrier)).squeeze(-1)

    @torch.no_grad()
    def predict_interval(self, numeric, carrier):
        """Point ETA and [P10, P90] band in hours, for the ops dashboard."""
        feats = self.features(numeric, carrier)
        point = self.point_head(feats)
        offsets = F.softplus(self.interval_head(feats))  # zoo: place
        lo, hi = point - offsets[:, :1], point + offsets[:, 1:]
        return torch.exp(point).squeeze(-1), torch.exp(torch.cat([lo, hi], dim=1))


def evaluate(model: EtaModel, numeric, carrier, log_hours):
    model.eval()
    point, band = model.predict_interval(numeric, carrier)
    hours = torch.exp(log_hours)
    mae = (point - hours).abs().mean().item()
    coverage = ((hours >= band[:, 0]) & (hours <= band[:, 1])).float().mean().item()
    model.train()
    return mae, coverage


def main():
    cfg = EtaConfig()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)

    numeric, carrier, log_hours = synth_voyages(cfg)
    split = int(0.9 * len(log_hours))
    train_set = TensorDataset(numeric[:split], carrier[:split], log_hours[:split])
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)

    model = DDP(EtaModel(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    step, t0 = 0, time.time()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for x_num, x_car, y in loader:
            pred = model(x_num, x_car)
            loss = F.smooth_l1_loss(pred, y, beta=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step} huber(log h) {loss.item():.4f}", flush=True)
            step += 1
        if rank == 0:
            mae, cov = evaluate(model.module, numeric[split:], carrier[split:], log_hours[split:])
            print(f"epoch {epoch} val MAE {mae:.1f} h, P10-P90 coverage {cov:.2%}", flush=True)
        dist.barrier()

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "eta_model.pt"))
        print(f"saved after {step} steps, {time.time() - t0:.1f}s", flush=True)
    dist.barrier()  # let rank 0 finish writing before tearing down gloo
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
