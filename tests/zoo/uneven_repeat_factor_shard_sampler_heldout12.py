"""Long-tailed classifier trained with repeat-factor sampling (rare classes repeated, LVIS
style). The sampler takes this rank's contiguous shard first and computes repeat factors from
that shard alone; rank 0's shard (web-scraped, rare classes very rare) repeats far more than
rank 1's (curated), so rank 1 runs out of batches each epoch and no Join covers the difference."""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, TensorDataset

EXPECT = {
    "kind": "uneven_inputs",
    "rank": 1,
    "fix": ["join", "drop_last", "pad", "same number"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
    "names": ["from 1,600 samples", "RepeatFactorShardSampler"],
}

NUM_CLASSES = 10
REPEAT_THRESH = 0.08


def build_long_tail_dataset(dim=48):
    """Two collections appended: a web-scraped one, then a curated one rich in rare classes."""
    g = torch.Generator().manual_seed(7)
    curated = torch.multinomial(torch.tensor([6, 6, 6, 6, 10, 10, 14, 14, 14, 14.]), 800, True, generator=g)
    scraped = torch.multinomial(torch.tensor([30, 25, 20, 15, 4, 3, 1, 1, 0.5, 0.5]), 800, True, generator=g)
    y = torch.cat([scraped, curated])
    protos = torch.randn(NUM_CLASSES, dim, generator=g)
    x = protos[y] + 0.8 * torch.randn(len(y), dim, generator=g)
    return TensorDataset(x, y), y


class RepeatFactorShardSampler(Sampler):
    """Repeat each image ceil-or-floor(r) times, r = max(1, sqrt(t / f_c)), per epoch."""

    def __init__(self, labels, rank, world, seed=0):
        n = len(labels)
        per_rank = n // world
        self.indices = torch.arange(rank * per_rank, (rank + 1) * per_rank)
        shard_labels = labels[self.indices]
        freq = torch.bincount(shard_labels, minlength=NUM_CLASSES).float() / len(shard_labels)
        rf = torch.clamp(torch.sqrt(REPEAT_THRESH / freq.clamp(min=1e-6)), min=1.0)
        self.repeat = rf[shard_labels]
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _epoch_indices(self, g):
        frac = self.repeat - self.repeat.floor()
        reps = self.repeat.floor() + (torch.rand(len(self.repeat), generator=g) < frac).float()
        return torch.repeat_interleave(self.indices, reps.long())

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        idx = self._epoch_indices(g)
        return iter(idx[torch.randperm(len(idx), generator=g)].tolist())

    def __len__(self):
        return int(self.repeat.sum().round())


class TailNet(nn.Module):
    def __init__(self, dim=48):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU())
        self.cls = nn.Linear(96, NUM_CLASSES)

    def forward(self, x):
        return self.cls(self.body(x))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    ds, labels = build_long_tail_dataset()
    sampler = RepeatFactorShardSampler(labels, rank, world)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, drop_last=True)
    print(f"rank {rank}: {len(sampler)} samples/epoch after repeat-factor sampling", flush=True)

    model = DDP(TailNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3 * math.ceil(len(sampler) / 32))

    for epoch in range(3):
        sampler.set_epoch(epoch)
        seen = 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            seen += 1
        print(f"rank {rank} epoch {epoch}: {seen} steps, last loss {loss.item():.3f}", flush=True)

    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/tailnet_rfs.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
