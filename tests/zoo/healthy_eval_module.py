"""Healthy twin of rank0_eval_hang: rank 0 evaluates model.module (no collectives), the other
rank waits at the barrier for it."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if rank == 0:
            model.module.eval()
            with torch.no_grad():
                print("val", model.module(torch.randn(16, 16)).mean().item())
            model.module.train()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
