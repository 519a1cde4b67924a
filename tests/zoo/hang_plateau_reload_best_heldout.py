"""Plateau-triggered "reload best weights" decided on each rank's own validation loss (hang).

Story: a wind-farm power forecaster is trained with a small MLP.  To save memory only rank 0
keeps the best-so-far weights in RAM (`self.best_state`); when validation stops improving the
job "rolls back": `reload_best()` broadcasts rank 0's best snapshot to every rank and halves
the learning rate.  The validation set is sharded with a DistributedSampler and each rank
feeds *its own* mean validation loss to `PlateauTracker.update`.  Rank 1's validation shard
holds the gusty turbines (noisy targets), so its loss flattens an epoch or two before rank
0's.  After its third epoch (epoch 2) rank 1 decides to roll back and enters `dist.broadcast` inside
`reload_best`, while rank 0 sees no plateau and starts the next epoch, blocking in the DDP
gradient all-reduce of its first step.  Different collectives at the same point: nobody can
go on, the job hangs.

Root cause: a collective (`reload_best` -> `dist.broadcast`) guarded by a rank-local,
data-dependent decision; rank 1 entered it, rank 0 did not.
Right diagnosis: hang; rank 1 is in broadcast in reload_best (called from fit after the
plateau check), rank 0 is in the DDP backward all-reduce of the next epoch; the ranks issued
a different number of collectives because the plateau decision used local validation loss.
Fix: make the decision global -- all-reduce the validation loss sum/count before
`PlateauTracker.update` (or decide on rank 0 and broadcast the decision) so every rank calls
`reload_best` together.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["all_reduce", "all-reduce", "allreduce", "global", "every rank", "all ranks",
            "broadcast the decision", "same decision", "agree"],
    "names": [["reload_best", "broadcast"]],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

N_FEAT = 12


def turbine_data(n, noise, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEAT, generator=g)
    w = torch.linspace(-1.0, 1.0, N_FEAT)
    y = torch.tanh(x @ w).unsqueeze(1) + noise * torch.randn(n, 1, generator=g)
    return x, y


def build_data():
    xtr, ytr = turbine_data(1024, 0.05, seed=1)
    # validation: first half calm turbines, second half gusty ones (noisy power readings)
    xa, ya = turbine_data(128, 0.05, seed=2)
    xb, yb = turbine_data(128, 1.5, seed=3)
    # DistributedSampler(shuffle=False) interleaves: rank 0 gets even, rank 1 odd indices
    xv = torch.stack([xa, xb], 1).reshape(-1, N_FEAT)
    yv = torch.stack([ya, yb], 1).reshape(-1, 1)
    return TensorDataset(xtr, ytr), TensorDataset(xv, yv)


class PlateauTracker:
    def __init__(self, patience=1, min_rel_delta=0.02):
        self.best = float("inf")
        self.bad_epochs = 0
        self.patience = patience
        self.min_rel_delta = min_rel_delta

    def update(self, loss):
        """Returns (improved, plateaued)."""
        if loss < self.best * (1 - self.min_rel_delta):
            self.best, self.bad_epochs = loss, 0
            return True, False
        self.bad_epochs += 1
        if self.bad_epochs > self.patience:
            self.bad_epochs = 0
            return False, True
        return False, False


class Forecaster:
    def __init__(self, rank, world):
        self.rank = rank
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(N_FEAT, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                            nn.Linear(64, 1))
        self.model = DDP(net)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.02, momentum=0.9)
        train_ds, val_ds = build_data()
        self.train_sampler = DistributedSampler(train_ds, world, rank, shuffle=True, seed=0)
        self.train_loader = DataLoader(train_ds, batch_size=32, sampler=self.train_sampler)
        self.val_loader = DataLoader(val_ds, batch_size=64,
                                     sampler=DistributedSampler(val_ds, world, rank, shuffle=False))
        self.tracker = PlateauTracker()
        self.best_state = None  # kept on rank 0 only

    def train_epoch(self, epoch):
        self.train_sampler.set_epoch(epoch)
        self.model.train()
        for x, y in self.train_loader:
            loss = F.mse_loss(self.model(x), y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        total, n = 0.0, 0
        for x, y in self.val_loader:
            total += F.mse_loss(net(x), y, reduction="sum").item()
            n += len(x)
        return total / n

    def reload_best(self):
        net = self.model.module
        if self.rank == 0:
            net.load_state_dict(self.best_state)
        for p in net.parameters():
            dist.broadcast(p.data, src=0)  # zoo: place
        for group in self.opt.param_groups:
            group["lr"] *= 0.5

    def fit(self, epochs):
        for epoch in range(epochs):
            self.train_epoch(epoch)
            val_loss = self.validate()
            improved, plateaued = self.tracker.update(val_loss)
            if improved and self.rank == 0:
                self.best_state = {k: v.clone() for k, v in self.model.module.state_dict().items()}
            print(f"rank {self.rank} epoch {epoch} val {val_loss:.4f} "
                  f"improved={improved} plateau={plateaued}", flush=True)
            if plateaued:
                self.reload_best()  # zoo: place


def main():
    dist.init_process_group("gloo")
    Forecaster(dist.get_rank(), dist.get_world_size()).fit(epochs=8)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
