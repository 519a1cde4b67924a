"""A plain shuffling DataLoader under DDP: every rank trains on the whole dataset."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {"kind": "missing_distributed_sampler", "rank": None, "fix": "DistributedSampler", "options": []}


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    loader = DataLoader(data, batch_size=8, shuffle=True)  # zoo: place
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _epoch in range(2):
        for x, y in loader:  # zoo: place
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
