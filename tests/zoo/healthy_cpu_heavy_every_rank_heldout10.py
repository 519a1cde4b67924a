"""Healthy twin of periodic_cpu_heavy_rank1_heldout10: every 5th step EVERY rank computes the same expensive
CPU diagnostic (32 dense 384x384 matrix products), so all ranks arrive at the next gradient
all-reduce together and nobody waits for anyone. 60 steps in total."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


def spectral_probe(weight: torch.Tensor) -> float:
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(384, 384, generator=g) / 20.0
    x = torch.randn(384, 384, generator=g)
    for _ in range(32):
        x = torch.tanh(x @ mix)
    return float(x.norm()) + float(weight.norm())


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(960, 16), torch.randint(0, 4, (960,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step % 5 == 4:
            spectral_probe(model.module[0].weight.detach())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
