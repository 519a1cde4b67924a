"""Every 5 steps rank 0 writes metrics to disk slowly (0.25 s) between optimizer.step() and the
next forward; rank 1 waits for it at the next gradient sync."""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "periodic_rank_work", "rank": 0, "fix": "background", "options": []}


def write_metrics(step: int, loss: float) -> None:
    time.sleep(0.25)  # a slow filesystem or a metrics server


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(480, 16), torch.randint(0, 4, (480,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 4:
            write_metrics(step, loss.item())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
