"""Each rank checks its shard's feature cache at the start of epoch 1; rank 1's is stale and it
rebuilds it in rebuild_feature_cache() (12 s) before the epoch's monitored_barrier(timeout=5 s).
Rank 0 raises "Rank 1 failed to pass monitoredBarrier": the root is rank 1 in its rebuild, the
timeout on rank 0 is the consequence."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None, "rank": 1, "fix": ["rebuild_feature_cache", "timeout"],
    "names": ["rebuild_feature_cache"], "options": [],
}

CACHE_VERSION = 3
ON_DISK_VERSION = {0: 3, 1: 2}  # what each rank's shard header says (rank 1's is stale)


def rebuild_feature_cache(features: torch.Tensor) -> torch.Tensor:
    means = []
    for chunk in features.split(16):
        means.append(chunk.mean(0))
        time.sleep(0.5)  # zoo: place
    return torch.stack(means)


def run_epoch(model, loader, opt):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    feats, target = torch.randn(384, 12), torch.randn(384, 1)
    data = TensorDataset(feats, target)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        if epoch == 1 and ON_DISK_VERSION[rank] != CACHE_VERSION:
            rebuild_feature_cache(feats)  # zoo: place
        dist.monitored_barrier(timeout=timedelta(seconds=5))
        run_epoch(model, loader, opt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
