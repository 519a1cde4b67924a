"""Healthy twin of periodic rank-only work: every 6th step EVERY rank computes the same
~60 ms of weight statistics (per-layer norms and histograms of the weights, for its own
local log) between optimizer.step() and the next forward. Both ranks do identical work, so
neither waits for the other at the next gradient all-reduce."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

STEPS = 48
PERIOD = 6


def weight_stats(model: nn.Module, rounds: int = 5) -> dict:
    stats = {}
    for name, p in model.named_parameters():
        w = p.detach().flatten()
        hist = torch.zeros(50)
        for r in range(rounds):
            scaled = w * (1.0 + 0.001 * r)
            hist += torch.histc(scaled, bins=50, min=-1.0, max=1.0)
            hist[0] += scaled.abs().sort().values[-1]
        stats[name] = (w.norm().item(), hist / rounds)
    return stats


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * 16, 32), torch.randint(0, 8, (STEPS * 16,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stats = {}
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step % PERIOD == PERIOD - 1:
            stats = weight_stats(model.module)  # zoo: place
    if dist.get_rank() == 0:
        print(f"final loss {loss.item():.3f}, stats for {len(stats)} tensors")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
