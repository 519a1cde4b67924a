"""Healthy twin: the classic CLI shape `sys.exit(main())`. main() trains for 2 epochs, runs a
short validation whose metrics are all_reduced across ranks, meets the others at a barrier,
destroys the process group and returns 0 (rank 0 first prints the metrics). Every rank ends
through the same sys.exit(0) at the same point. Nothing is wrong."""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    model.eval()
    stats = torch.zeros(3)  # loss sum, correct, count
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            stats[0] += nn.functional.cross_entropy(out, y, reduction="sum")
            stats[1] += (out.argmax(1) == y).sum()
            stats[2] += len(y)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(224, 16)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()
    train, val = TensorDataset(x[:160], y[:160]), TensorDataset(x[160:], y[160:])
    sampler = DistributedSampler(train, seed=0)
    loader = DataLoader(train, batch_size=8, sampler=sampler)
    val_loader = DataLoader(val, batch_size=16, sampler=DistributedSampler(val, shuffle=False))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        val_loss, acc = evaluate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.3f} acc {acc:.2%}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
