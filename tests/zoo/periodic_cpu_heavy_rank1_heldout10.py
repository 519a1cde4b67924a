"""Every 5th step rank 1 (not rank 0) computes an expensive diagnostic of its own: a chain of
32 dense 384x384 matrix products (about 60-90 ms of pure CPU work, no sleeping), between
optimizer.step() and the next forward. Rank 0 waits for it at the next gradient all-reduce.
60 steps in total."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": "periodic_rank_work",
    "rank": 1,
    "fix": ["background", "less often", "asynchronous", "every rank"],
    "options": [],
}


def spectral_probe(weight: torch.Tensor) -> float:
    """A made-up but honest CPU-heavy metric: power iterations through a random mixing matrix."""
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(384, 384, generator=g) / 20.0
    x = torch.randn(384, 384, generator=g)
    for _ in range(32):
        x = torch.tanh(x @ mix)
    return float(x.norm()) + float(weight.norm())


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
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
        if rank == 1 and step % 5 == 4:
            spectral_probe(model.module[0].weight.detach())  # zoo: place
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
