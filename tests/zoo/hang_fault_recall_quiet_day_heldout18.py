"""A per-epoch recall sync that one rank skips on a day without faults -> hang.

Story: a fault detector for pump vibration windows trains on every rank's own shard and,
after each epoch, validates on that epoch's "day" of held-out windows (the validation set
rotates one day per epoch).  `ValidationReport.sync()` computes precision and recall on the
rank's day and all-reduces them so rank 0 can log the global figures.  Every epoch so far
both ranks made that all_reduce.  In epoch 3, rank 1's validation day was a quiet one: no
fault windows at all, so `tp / (tp + fn)` raises ZeroDivisionError.  The author wrapped the
sync in try/except "so a bad metric never kills a training run", so rank 1 prints a note and
goes on to the next epoch, whose first backward issues DDP's gradient all-reduce; rank 0
waits in the metrics all_reduce of epoch 3 (on the separate metrics group) that rank 1 never
makes, and rank 1 waits in the gradient all-reduce for rank 0.

Root cause: rank 1 (it skipped the metrics all_reduce that every earlier epoch made).
Fix: compute the counts first and all-reduce them on every rank (tp, fp, fn as a tensor, zeros
allowed), then divide the global sums; never skip a collective on one rank.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)

EXPECT = {
    "kind": ["rank_only_collective", "hang"],
    "rank": 1,
    "fix": ["all_reduce", "allreduce", "all-reduce", "every rank", "all ranks", "collective",
            "zero", "counts"],
    "names": ["all_reduce"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


class FaultNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 5, padding=2)
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.conv(x.unsqueeze(1))).mean(-1)
        return self.fc(h).squeeze(-1)


def make_windows(seed, n, fault_rate):
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) < fault_rate).float()
    t = torch.linspace(0, 6.28, 64)
    x = 0.3 * torch.randn(n, 64, generator=g) + torch.sin(4 * t)
    x = x + y[:, None] * torch.sin(17 * t) * 0.8
    return x, y


class ValidationReport:
    def __init__(self, rank, group):
        self.rank = rank
        self.group = group
        self.tp = self.fp = self.fn = 0

    def update(self, logits, y):
        pred = logits > 0
        self.tp += int((pred & (y > 0)).sum())
        self.fp += int((pred & (y == 0)).sum())
        self.fn += int((~pred & (y > 0)).sum())

    def sync(self, epoch):
        try:
            precision = self.tp / max(self.tp + self.fp, 1)
            recall = self.tp / (self.tp + self.fn)
            stats = torch.tensor([precision, recall])
            dist.all_reduce(stats, group=self.group)  # zoo: place
            stats /= dist.get_world_size()
            return stats.tolist()
        except ZeroDivisionError:
            print(f"[rank {self.rank}] epoch {epoch}: no fault windows in this day's data, "
                  "skipping metrics", flush=True)
            return None


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    # metrics travel on their own gloo group, so on GPU nodes they never queue behind NCCL
    metrics_group = dist.new_group(backend="gloo")
    model = DDP(FaultNet())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    train_x, train_y = make_windows(10 + rank, 512, fault_rate=0.3)
    # one validation day per epoch; rank 1's day 3 was quiet (the pump never faulted)
    days = [make_windows(100 + 10 * rank + d, 64,
                         fault_rate=0.0 if (rank, d) == (1, 3) else 0.25) for d in range(6)]

    for epoch in range(6):
        for i in range(0, 512, 64):
            loss = F.binary_cross_entropy_with_logits(model(train_x[i:i + 64]), train_y[i:i + 64])
            opt.zero_grad()
            loss.backward()
            opt.step()
        report = ValidationReport(rank, metrics_group)
        vx, vy = days[epoch]
        with torch.no_grad():
            report.update(model.module(vx), vy)
        stats = report.sync(epoch)
        if rank == 0 and stats is not None:
            print(f"epoch {epoch} loss {loss.item():.4f} precision {stats[0]:.3f} "
                  f"recall {stats[1]:.3f}", flush=True)

    dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), os.devnull)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
