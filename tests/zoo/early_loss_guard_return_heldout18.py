"""A loss-spike guard returns out of the trainer on one rank only; that rank exits cleanly.

Story: a delivery-time regressor is trained from per-region shards by a small `Trainer`
class.  `Trainer.fit()` walks epochs, then the region's weekly files, then the batches of
each file.  To "protect the run from blow-ups" the author added a guard in the innermost loop:
if the batch loss is more than 25x the running average, it prints a warning and returns
from `fit()`.  The loss it looks at is the rank's own batch loss, never shared.  Rank 1's
week-5 file was exported in minutes instead of hours (an upstream unit change), so in epoch 0
one of its batches has a huge loss: rank 1 returns from `fit()`, saves nothing (only rank 0
saves), tears down its process group and exits with status 0.  Rank 0 had normal batches, goes
on to the next step and its gradient all-reduce has no partner any more: it fails with a
connection error.

Root cause: rank 1 (it left the training loop early by a decision made on its own data).
Fix: decide collectively -- all-reduce the loss (or a stop flag) so every rank takes the same
decision, or skip the bad batch without leaving the loop.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)

EXPECT = {
    "kind": ["rank_left_early"],
    "rank": 1,
    "fix": ["all_reduce", "allreduce", "all-reduce", "broadcast", "every rank", "all ranks",
            "agree", "collective", "synchron", "same decision"],
    "options": [],
}


def weekly_files(rank, weeks=8, rows=96):
    files = []
    for week in range(weeks):
        g = torch.Generator().manual_seed(500 + 17 * rank + week)
        x = torch.randn(rows, 10, generator=g)
        hours = 2.0 + x[:, :4].sum(1).abs() * 0.5 + 0.1 * torch.randn(rows, generator=g)
        if rank == 1 and week == 5:
            hours = hours * 60.0  # this region's week-5 export switched to minutes
        files.append((x, hours))
    return files


class Trainer:
    def __init__(self, model, rank, files, batch_size=32, spike_factor=25.0):
        self.model = model
        self.rank = rank
        self.files = files
        self.batch_size = batch_size
        self.spike_factor = spike_factor
        self.opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        self.avg_loss = None

    def _batches(self, x, y):
        for i in range(0, len(x), self.batch_size):
            yield x[i:i + self.batch_size], y[i:i + self.batch_size]

    def fit(self, epochs):
        for epoch in range(epochs):
            for week, (x, y) in enumerate(self.files):
                for xb, yb in self._batches(x, y):
                    loss = F.mse_loss(self.model(xb), yb)
                    value = loss.item()
                    if self.avg_loss is not None and value > self.spike_factor * self.avg_loss:
                        print(f"[rank {self.rank}] epoch {epoch} week {week}: loss {value:.1f} "
                              f"spiked (avg {self.avg_loss:.3f}), stopping training", flush=True)
                        return False  # zoo: place
                    self.avg_loss = value if self.avg_loss is None else 0.9 * self.avg_loss + 0.1 * value
                    self.opt.zero_grad()
                    loss.backward()
                    self.opt.step()
            if self.rank == 0:
                print(f"epoch {epoch} avg loss {self.avg_loss:.4f}", flush=True)
        return True


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Regressor())
    trainer = Trainer(model, rank, weekly_files(rank))
    finished = trainer.fit(epochs=3)
    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/delivery_regressor.pt")
        print(f"training finished: {finished}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
