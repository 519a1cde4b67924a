"""Healthy twin of monitored_barrier_slow_rank: every rank refreshes its (small) feature
statistics at the start of each epoch, then meets the others at a monitored_barrier with a
generous timeout. Nothing is wrong."""

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


def feature_stats(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return features.mean(0), features.std(0)


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    feats, target = torch.randn(384, 12), torch.randn(384, 1)
    data = TensorDataset(feats, target)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        mean, std = feature_stats(feats)
        dist.monitored_barrier(timeout=timedelta(seconds=60))
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model((x - mean) / std), y).backward()
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
