"""Rank 1's DataLoader worker decodes a huge record and is killed by the kernel (SIGKILL, what
the OOM killer sends) in Dataset.__getitem__; rank 1's main process raises "DataLoader worker
... is killed by signal: Killed" and rank 0 is left in its gradient all-reduce. A right
diagnosis names rank 1, the killed worker and its signal, and gives memory / loader advice."""

import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = {
    "kind": None, "rank": 1, "fix": ["memory", "OOM", "num_workers"],
    "names": ["worker", ["SIGKILL", "Killed"]],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

HUGE_RECORD = 85


class Records(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if i == HUGE_RECORD:
            time.sleep(1.5)  # decoding the huge record...
            os.kill(os.getpid(), signal.SIGKILL)  # zoo: place  (...until the OOM killer steps in)
        return self.x[i], self.y[i]


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = Records(192)
    sampler = DistributedSampler(data, shuffle=False)  # record 85 lands on rank 1
    loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=1)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:  # zoo: place
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
