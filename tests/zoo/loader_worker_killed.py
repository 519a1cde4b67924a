"""A DataLoader worker of rank 1 is killed by a signal (SIGKILL, as the kernel's OOM killer
does) while it loads a batch: the rank's main process raises "DataLoader worker ... is killed by
signal". The diagnosis names the signal and gives memory and loader advice."""

import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = {"kind": "rank_failure", "rank": 1, "fix": "num_workers", "options": []}


class Images(Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        info = torch.utils.data.get_worker_info()
        if int(os.environ["RANK"]) == 1 and i % 64 == 7 and info is not None:
            os.kill(os.getpid(), signal.SIGKILL)  # stands in for the OOM killer
        return torch.randn(16), i % 4


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = Images()
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0), num_workers=2)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:  # zoo: place
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
