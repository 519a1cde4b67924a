"""Rank 1 does extra work in every forward (a per-sample augmentation done in Python): it arrives
last at every gradient sync."""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "straggler", "rank": 1, "fix": "forward", "options": []}


class Net(nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.slow = slow
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        if self.slow:
            time.sleep(0.03)
        return self.body(x)


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(320, 16), torch.randint(0, 4, (320,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(Net(slow=dist.get_rank() == 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
