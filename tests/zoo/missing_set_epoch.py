"""DistributedSampler with shuffle, but no sampler.set_epoch(epoch): every epoch replays the
same order."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "missing_set_epoch", "rank": None, "fix": "set_epoch", "options": []}


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _epoch in range(3):
        for x, y in loader:  # zoo: place
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
