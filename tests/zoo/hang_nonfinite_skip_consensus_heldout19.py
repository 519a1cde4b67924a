"""A "skip the bad batch together" guard that only the rank with the bad batch enters -> hang.

Story: a next-hour temperature forecaster for a network of weather stations.  Each rank owns
the stations whose id has its parity (rank 0 the even ids, rank 1 the odd ones) and trains a
small MLP on 24-hour windows.  Old loggers write a missing reading as the float maximum
(3.4e38), and a window holding one blows the loss up to inf/nan.  The author wrote a
"consensus skip": `BadBatchGuard.vote_skip()` gathers every rank's verdict with
`all_gather_object` so that all ranks drop the step together and DDP never sees a half-done
backward.  To avoid "a sync on every step", the vote is only called `if not
torch.isfinite(loss)`: a per-rank, data-dependent condition.  Station 7 (rank 1) has a
missing reading, so in epoch 0 rank 1 enters the vote (an all_gather) while rank 0, whose
loss was finite, goes on to backward and waits in DDP's gradient all-reduce.  The ops differ
(all_gather vs all_reduce), so neither ever completes: the job hangs.

Root cause: rank 1 (it issued the all_gather of the vote that rank 0 never issues).
Fix: vote on every rank every step (all_reduce a 0/1 flag of `isfinite(loss)` on all ranks,
then all skip together), or clean the sentinel readings in the data pipeline.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["rank_only_collective", "collective_mismatch", "hang"],
    "rank": 1,
    "fix": ["every rank", "all ranks", "each rank", "every step", "isfinite", "flag",
            "all_reduce", "all-reduce", "sentinel", "clean"],
    "names": [["all_gather", "vote_skip"]],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

MISSING = 3.4e38
N_STATIONS = 16
HOURS = 24 * 30


def station_series(station):
    g = torch.Generator().manual_seed(1000 + station)
    t = torch.arange(HOURS, dtype=torch.float32)
    base = 10 + 8 * torch.sin(2 * math.pi * (t / 24) - 1.3) + 0.5 * station
    series = base + 1.5 * torch.randn(HOURS, generator=g)
    if station == 7:
        series[400] = MISSING  # a logger dropout, written the old way
    return series


def windows(stations, span=24):
    xs, ys = [], []
    for s in stations:
        series = station_series(s)
        for start in range(0, HOURS - span - 1, 6):
            xs.append(series[start:start + span])
            ys.append(series[start + span])
    return torch.stack(xs), torch.stack(ys)


class Forecaster(nn.Module):
    def __init__(self, span=24, hidden=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(span, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x / 30.0).squeeze(-1) * 30.0


class BadBatchGuard:
    """All ranks must agree to skip a step, or DDP is left with a half-done reduction."""

    def __init__(self):
        self.skipped = 0

    def vote_skip(self, local_bad):
        votes = [None] * dist.get_world_size()
        dist.all_gather_object(votes, bool(local_bad))  # zoo: place
        skip = any(votes)
        self.skipped += int(skip)
        return skip


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(Forecaster())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    guard = BadBatchGuard()

    x, y = windows(range(rank, N_STATIONS, world))
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True,
                        generator=torch.Generator().manual_seed(7), drop_last=True)

    for epoch in range(3):
        total, n = 0.0, 0
        for xb, yb in loader:
            loss = F.mse_loss(model(xb), yb)
            if not torch.isfinite(loss):  # noqa: SIM102 (the vote runs on the rank that saw it)
                if guard.vote_skip(True):
                    opt.zero_grad(set_to_none=True)
                    continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item()
            n += 1
        if rank == 0:
            print(f"epoch {epoch}: mse {total / max(n, 1):.3f} ({guard.skipped} skipped)", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
