"""Next-day realized-volatility forecasting with a curriculum-enabled regime adapter, 2-rank CPU DDP.

What the job does
    Trains a GRU forecaster on synthetic daily-return windows (GARCH-like
    volatility clustering) to predict next-day log realized volatility. A
    "regime adapter" that conditions on market-wide features (index return,
    VIX-like level, rate change) is switched on by a curriculum only after
    cfg.regime_warmup_steps optimizer steps, so the single-name dynamics are
    learned first.

Root cause
    The curriculum decides per step whether the regime branch runs: the loop
    passes ``use_regime=global_step >= cfg.regime_warmup_steps`` into forward,
    and forward skips ``self.regime_adapter`` when the flag is False. During the
    first steps the adapter's parameters get no gradient. DDP uses
    find_unused_parameters=False, so the reducer never completes and the
    second forward raises "Expected to have finished reduction in the prior
    iteration before starting a new one" -- long before the curriculum would
    have switched the branch on.

Fix
    Always run the adapter and ramp its contribution instead of skipping it
    (``h = h + regime_scale * self.regime_adapter(market)`` with
    regime_scale=0.0 during warm-up), or wrap with
    find_unused_parameters=True.

What a plain run shows
    torchrun ... --nproc_per_node 2 exits 1 (ChildFailedError) after ~4-5 s wall.
    Step 0 runs with use_regime=False and logs; on step 1 BOTH ranks raise
    from DDP._pre_forward at the `pred = model(past, market, use_regime=...)`
    call: "RuntimeError: Expected to have finished reduction in the prior
    iteration before starting a new one. ..." with "Parameter indices which
    did not receive grad for rank N: 4 5 6 7" (regime_adapter.film). The
    curriculum (warm-up 25 steps) is never reached. Both ranks fail at the same
    step; torchrun's "Root Cause (first observed failure)" names whichever
    exited first (rank 0 in most runs, rank 1 in some).
"""
import math
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

EXPECT = {
    "kind": ["unused_parameters"],
    "rank": None,
    "fix": ["find_unused_parameters", "regime_adapter", "use_regime"],
    "options": [],
}


@dataclass
class VolConfig:
    window: int = 40
    n_market: int = 3
    hidden: int = 48
    num_series: int = 96
    days_per_series: int = 200
    batch_size: int = 32
    epochs: int = 2
    lr: float = 3e-3
    regime_warmup_steps: int = 25
    seed: int = 2024
    out_dir: str = field(
        default_factory=lambda: os.path.join(
            tempfile.gettempdir(), "ddpdoctor-zoo", "stock_volatility"
        )
    )


def simulate_garch(num_series, days, g):
    """GARCH(1,1)-style returns with a shared market factor."""
    omega, alpha, beta = 1e-5, 0.08, 0.9
    market = torch.randn(days, generator=g) * 0.01
    vix = torch.zeros(days)
    rates = torch.cumsum(torch.randn(days, generator=g) * 0.002, 0)
    returns = torch.zeros(num_series, days)
    var = torch.full((num_series,), 1e-4)
    for t in range(days):
        eps = torch.randn(num_series, generator=g)
        returns[:, t] = 0.5 * market[t] + var.sqrt() * eps
        var = omega + alpha * returns[:, t] ** 2 + beta * var
        vix[t] = var.mean().sqrt() * math.sqrt(252)
    market_feats = torch.stack([market * 100, vix, torch.diff(rates, prepend=rates[:1]) * 100], dim=1)
    return returns, market_feats


class VolWindowDataset(Dataset):
    def __init__(self, cfg: VolConfig):
        g = torch.Generator().manual_seed(cfg.seed)
        returns, market = simulate_garch(cfg.num_series, cfg.days_per_series, g)
        self.items = []
        for s in range(cfg.num_series):
            for t in range(cfg.window, cfg.days_per_series - 1, 10):
                past = returns[s, t - cfg.window:t] * 100.0
                target = torch.log(returns[s, t].abs() * 100.0 + 1e-2)
                self.items.append((past.unsqueeze(-1), market[t - 1], target))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        return self.items[idx]


class RegimeAdapter(nn.Module):
    def __init__(self, n_market, hidden):
        super().__init__()
        self.film = nn.Sequential(nn.Linear(n_market, hidden), nn.Tanh(), nn.Linear(hidden, hidden))

    def forward(self, market):
        return self.film(market)


class VolForecaster(nn.Module):
    def __init__(self, cfg: VolConfig):
        super().__init__()
        self.gru = nn.GRU(input_size=1, hidden_size=cfg.hidden, batch_first=True)
        self.regime_adapter = RegimeAdapter(cfg.n_market, cfg.hidden)
        self.head = nn.Sequential(nn.Linear(cfg.hidden, cfg.hidden), nn.GELU(), nn.Linear(cfg.hidden, 1))

    def forward(self, past_returns, market, use_regime: bool = True):
        _, h = self.gru(past_returns)
        h = h.squeeze(0)
        if use_regime:  # zoo: place
            h = h + self.regime_adapter(market)
        return self.head(h).squeeze(-1)


def qlike(pred_log_vol, target_log_vol):
    """QLIKE-style loss on log vol, robust to vol spikes."""
    ratio = torch.exp(2 * (target_log_vol - pred_log_vol))
    return (ratio - 2 * (target_log_vol - pred_log_vol) - 1).mean()


def main():
    cfg = VolConfig()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)

    dataset = VolWindowDataset(cfg)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)

    model = DDP(VolForecaster(cfg), find_unused_parameters=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs * len(loader))

    global_step = 0
    t0 = time.time()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        running = 0.0
        for past, market, target in loader:
            pred = model(past, market, use_regime=global_step >= cfg.regime_warmup_steps)
            loss = qlike(pred, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running += loss.item()
            if rank == 0 and global_step % 10 == 0:
                mae = F.l1_loss(pred.detach(), target).item()
                print(f"epoch {epoch} step {global_step} qlike {loss.item():.4f} "
                      f"mae(log vol) {mae:.3f}", flush=True)
            global_step += 1
        if rank == 0:
            print(f"epoch {epoch} mean qlike {running / max(1, len(loader)):.4f}", flush=True)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "vol_forecaster.pt"))
        print(f"done in {time.time() - t0:.1f}s", flush=True)
    dist.barrier()  # let rank 0 finish writing before tearing down gloo
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
