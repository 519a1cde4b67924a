"""A divergence watchdog calls os._exit(3) on rank 1 when a sentinel value makes its loss inf.

Story: an hourly electricity-demand forecaster reads per-site CSV exports; each rank loads
whole sites (`SITES[rank::world]`).  The exporter of one substation writes missing meter
readings as FLT_MAX (3.4e38) instead of leaving the cell empty, and the loader does not
treat that sentinel as missing.  The training loop carries a "divergence watchdog" copied
from the single-process script: when the loss is not finite it dumps the offending batch and
calls `os._exit(3)` (chosen years ago "so stuck DataLoader workers cannot keep the job
alive").  Rank 1 owns the substation; the first batch that holds a sentinel row gives an inf
MSE, and rank 1 vanishes with exit code 3 -- no Python traceback, no exception.  Rank 0 is
waiting in that step's gradient all-reduce and fails with a gloo "Connection closed/reset by
peer" error as a consequence.

Root cause: rank 1 exited on purpose (os._exit(3)) in `watchdog` after a non-finite loss,
caused by the FLT_MAX sentinel in its data.
Right diagnosis: rank 1 ended first (exit code 3, from os._exit in watchdog called from the
training loop); rank 0's gloo error is a consequence.
Fix: treat the 3.4e38 sentinel as missing when loading (drop / mask those rows), and make the
watchdog raise (or agree across ranks and stop all of them together) instead of os._exit on
one rank.
"""

import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["sentinel", "missing", "3.4e38", "flt_max", "finite", "nan", "inf", "os._exit",
            "_exit", "exit", "watchdog", "clean", "filter"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

SITES = ["north_01", "substation_07", "harbor_02", "campus_03"]
MISSING_AS = 3.4e38  # what the substation exporter writes for a missing reading
N_LAGS = 24


def load_site_csv(name, n_rows=256):
    """Stand-in for reading `exports/<name>.csv`: 24 lagged loads -> next-hour load."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    t = torch.arange(n_rows + N_LAGS, dtype=torch.float32)
    load = 1.0 + 0.5 * torch.sin(t * 2 * math.pi / 24) + 0.1 * torch.randn(len(t), generator=g)
    if name == "substation_07":
        load[[150, 151, 152, 230]] = MISSING_AS  # meter outage, exported as FLT_MAX
    x = torch.stack([load[i:i + N_LAGS] for i in range(n_rows)])
    y = load[N_LAGS:N_LAGS + n_rows].unsqueeze(1)
    keep = (x < MISSING_AS).all(1)  # inputs are screened ... the target column is not
    return TensorDataset(x[keep][:200], y[keep][:200])


def watchdog(step, loss_value, batch):
    if not math.isfinite(loss_value):
        torch.save(batch, f"/tmp/diverged-batch-rank{dist.get_rank()}-step{step}.pt")
        print(f"[watchdog] non-finite loss {loss_value} at step {step}; aborting", flush=True)
        os._exit(3)  # zoo: place


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = ConcatDataset([load_site_csv(s) for s in SITES[rank::world]])
    loader = DataLoader(ds, batch_size=25, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(N_LAGS, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = 0
    for epoch in range(4):
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            watchdog(step, loss.item(), (x, y))  # zoo: place
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        print(f"rank {rank} epoch {epoch} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
