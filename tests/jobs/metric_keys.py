"""Metrics all-reduced one key at a time, every SYNC steps; rank 1's dict gets a key the other
rank's lacks (an "oov_rate" only a rank that saw unknown tokens reports).

Usage: metric_keys.py {first|later}
  first   the extra key at the job's first sync: no earlier round says whose count is right
  later   three syncs of two keys on every rank, then the extra key at the fourth
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

SYNC = 5


def snapshot(rank: int, sync: int, extra_at: int) -> dict[str, torch.Tensor]:
    metrics = {"loss": torch.tensor(1.0), "acc": torch.tensor(0.5)}
    if rank == 1 and sync == extra_at:
        metrics["oov_rate"] = torch.tensor(0.1)  # a key of this rank's own
    return metrics


def sync_metrics(metrics: dict[str, torch.Tensor]) -> None:
    for value in metrics.values():
        dist.all_reduce(value)


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra_at = 0 if mode == "first" else 3
    for step in range(40):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        if (step + 1) % SYNC == 0:
            sync_metrics(snapshot(rank, (step + 1) // SYNC - 1, extra_at))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
