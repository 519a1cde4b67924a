"""HEALTHY: a custom autograd Function with a heavier backward, the same on every rank.

Story: a regression MLP whose hidden features pass through `LaplacianSmooth`, a custom
`torch.autograd.Function`: identity in forward, and in backward the gradient is smoothed
along the feature axis by solving (I + lam * L) g' = g with a fresh `torch.linalg.solve`
(L: the chain-graph Laplacian), re-built every call.  That makes every step about half
again as long as with a plain identity -- but on every rank alike, for the same shapes, so
no rank waits for another at the gradient all-reduce.  DistributedSampler + set_epoch, Adam,
3 epochs.

Right diagnosis: nothing to report (no warning, no error).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

HIDDEN = 320


class LaplacianSmooth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, lam):
        ctx.lam = lam
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[1]
        lap = 2 * torch.eye(n) - torch.diag(torch.ones(n - 1), 1) - torch.diag(torch.ones(n - 1), -1)
        lap[0, 0] = lap[-1, -1] = 1.0
        smoothed = torch.linalg.solve(torch.eye(n) + ctx.lam * lap, grad.T).T
        return smoothed, None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(16, HIDDEN), nn.SiLU())
        self.out = nn.Sequential(nn.Linear(HIDDEN, 64), nn.SiLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.out(LaplacianSmooth.apply(self.inp(x), 0.5)).squeeze(-1)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(21)
    x = torch.randn(1536, 16, generator=g)
    y = torch.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2]
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = DDP(Net())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        total = 0.0
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch} loss {total / len(loader):.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
