"""County-level maize yield regression from seasonal weather and soil features.

An MLP predicts yield (t/ha) from growing-season rainfall, growing degree days, heat-stress
days, soil organic carbon and planting date. Counties are split across ranks by state; each
rank also holds its own validation counties and runs an EarlyStopping helper (patience 3)
on its *local* validation loss at the end of every epoch. Rank 0's validation counties were
hit by hail in the target year, so their yields are essentially unpredictable: the local
validation loss stops improving after a few epochs and rank 0 breaks out of the epoch loop,
saves its checkpoint and waits at the final barrier -- while rank 1, whose validation loss keeps
improving, starts the next epoch and blocks in DDP's gradient all-reduce forever.

Root cause: the early-stopping decision (`if stopper.step(val_loss): break`) is taken per rank
from a per-rank metric, so rank 0 leaves the training loop while rank 1 keeps training.
Plain run (measured): rank 0's val loss goes 10.67 -> 15.54 -> 18.60 -> 19.04 and it prints
"rank 0: early stop at epoch 3"; rank 1 (val 6.23 -> 0.96 -> 0.59 -> 0.46) enters epoch 4 and
never prints again; the job was still alive after 60 s (killed by timeout, rc 124).
Fix: make the stop decision collectively -- all_reduce the validation loss (or the stop flag,
e.g. MAX/SUM of a 0/1 tensor) so that every rank breaks at the same epoch.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

OUT = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
os.makedirs(OUT, exist_ok=True)

EXPECT = {
    "kind": ["rank_left_early", "uneven_inputs", "hang"],
    "rank": 0,
    "fix": [
        "all_reduce",
        "allreduce",
        "every rank",
        "all ranks",
        "same epoch",
        "collective",
        "global",
        "broadcast",
        "stop flag",
        "agree",
        "synchron",
        "early stop",
        "together",
        "consensus",
    ],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


def synth_counties(n, seed, hail=False):
    g = torch.Generator().manual_seed(seed)
    rain = torch.rand(n, generator=g) * 600 + 200  # mm
    gdd = torch.rand(n, generator=g) * 1200 + 1800
    heat = torch.poisson(torch.full((n,), 6.0), generator=g)
    soc = torch.rand(n, generator=g) * 3 + 0.5
    plant = torch.rand(n, generator=g) * 40  # days after 15 April
    x = torch.stack([(rain - 500) / 200, (gdd - 2400) / 400, heat / 10, soc / 3, plant / 40], 1)
    y = 9 + 1.5 * x[:, 0] - 0.8 * x[:, 0] ** 2 + 1.0 * x[:, 1] - 2.0 * x[:, 2] + 0.8 * x[:, 3] - 0.6 * x[:, 4]
    y = y + 0.3 * torch.randn(n, generator=g)
    if hail:
        y = torch.rand(n, generator=g) * 10
    return x, y


class EarlyStopping:
    def __init__(self, patience=3, min_delta=1e-3):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.bad = float("inf"), 0

    def step(self, metric):
        if metric < self.best - self.min_delta:
            self.best, self.bad = metric, 0
        else:
            self.bad += 1
        return self.bad >= self.patience


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, y = synth_counties(1200, seed=20 + rank)
    xv, yv = synth_counties(300, seed=50 + rank, hail=(rank == 0))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(5, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=2e-3, momentum=0.9)
    stopper = EarlyStopping(patience=3)
    bs = 60
    for epoch in range(40):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for k in range(0, len(x), bs):
            idx = perm[k : k + bs]
            loss = F.mse_loss(model(x[idx]).squeeze(-1), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            val_loss = F.mse_loss(model.module(xv).squeeze(-1), yv).item()
        print(f"rank {rank} epoch {epoch} train {loss.item():.3f} val {val_loss:.3f}", flush=True)
        if stopper.step(val_loss):  # zoo: place
            print(f"rank {rank}: early stop at epoch {epoch}", flush=True)
            break
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(OUT, "maize_mlp.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
