"""Healthy: a tiny tabular regressor with very short steps (plain DDP, DistributedSampler,
set_epoch every epoch).

Story: a house-price style regression on 12 standardized numeric features.  The model is a
12-24-1 tanh MLP, batch 16 per rank, 640 rows -> 20 steps per epoch on each rank, 4 epochs
(80 steps).  A step is about a millisecond, so the whole training loop is well under a second;
the ranks do exactly the same amount of work (same shapes, same sampler-sharded data) and
wait for each other only in the gradient all-reduce, by scheduling noise.

Right diagnosis: nothing to report (no warning, no error).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None


def make_data(n=640, d=12, seed=11):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = make_data()
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
    model = DDP(nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
