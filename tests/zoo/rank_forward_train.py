"""Rank 0 runs an extra forward through the DDP wrapper (train mode, no_grad) every 5 steps to
print predictions. Nothing hangs, but rank 0 runs forwards rank 1 does not: with buffers or
grad enabled the same line would hang the job."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "rank_only_forward", "rank": 0, "fix": "model.module", "options": []}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(320, 16), torch.randint(0, 4, (320,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe = torch.randn(4, 16)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            with torch.no_grad():
                print(model(probe).argmax(1).tolist())  # zoo: place
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
