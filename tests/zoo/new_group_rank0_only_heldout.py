"""Rank 0 sets up a metrics logger with its own process group, dist.new_group([0, 1]), inside
`if rank == 0:`; creating a group is a collective of the default group that rank 1 never
calls. Rank 0 waits in new_group while rank 1 waits in DDP's parameter broadcast."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None, "rank": 0, "fix": ["every rank", "all ranks"], "names": ["new_group"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


class MetricLogger:
    def __init__(self, group) -> None:
        self.group = group
        self.rows: list[float] = []

    def log(self, value: float) -> None:
        self.rows.append(value)


def make_logger(rank: int):
    if rank != 0:
        return None
    group = dist.new_group([0, 1])  # zoo: place
    return MetricLogger(group)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logger = make_logger(rank)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if logger is not None:
            logger.log(loss.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
