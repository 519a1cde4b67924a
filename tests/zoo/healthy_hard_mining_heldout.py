"""HEALTHY: rank-dependent data and augmentation, but equal-sized work on every rank.

Story: an image-ish classifier with online hard-example mining.  The dataset has 1001
samples, which does not split evenly, but DistributedSampler pads the shards to the same
length, so both ranks run the same number of steps.  Each rank seeds its augmentation
(noise + random flips) with its rank, so the *content* differs per rank; the mining step
computes per-sample losses on a 48-sample batch and back-propagates only the top-16 --
a fixed k, so every rank does the same amount of work and the graph (all parameters used)
is the same.  The sampler's set_epoch is called on every rank.  Exits 0.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = None


class RankAugment:
    def __init__(self, rank, strength):
        self.g = torch.Generator().manual_seed(1000 + rank)
        self.strength = strength

    def __call__(self, x):
        flip = torch.rand(x.shape[0], generator=self.g) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return x + self.strength * torch.randn(x.shape, generator=self.g)


def top_k_loss(logits, y, k):
    per_sample = F.cross_entropy(logits, y, reduction="none")
    hard, _ = per_sample.topk(k)
    return hard.mean()


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data_g = torch.Generator().manual_seed(0)
    xs = torch.randn(1001, 1, 12, 12, generator=data_g)
    ys = (xs.mean((1, 2, 3)) > 0).long() + 2 * (xs[:, 0, :6].mean((1, 2)) > 0).long()
    ds = TensorDataset(xs, ys)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=48, sampler=sampler)
    augment = RankAugment(rank, strength=0.05 if rank == 0 else 0.1)
    model = DDP(
        nn.Sequential(
            nn.Conv2d(1, 12, 3),
            nn.ReLU(),
            nn.Conv2d(12, 12, 3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(12 * 8 * 8, 4),
        )
    )
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    step = 0
    for epoch in range(6):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = top_k_loss(model(augment(x)), y, k=16)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        if rank == 0:
            print(f"epoch {epoch} steps {step} loss {loss.item():.3f}", flush=True)
    cs = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"rank {rank} steps {step} checksum {cs:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
