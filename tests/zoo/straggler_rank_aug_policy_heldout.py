"""Rank 1 draws the expensive "elastic" augmentation policy and slows every step (straggler).

Story: a land-cover classifier on 32x32 satellite tiles.  Someone read that "augmentation
diversity across replicas helps" and made the augmentation policy depend on the rank:
`AUG_POLICIES[rank % len(AUG_POLICIES)]`.  Rank 0 gets "flip_crop" (cheap); rank 1 gets
"elastic", which builds a smoothed random displacement field per tile (a 2-D Gaussian blur
with a 21x21 kernel) and resamples the tile with `grid_sample` -- 2-3x the cost of
everything else in the step.  It runs in `TileDataset.__getitem__` (num_workers=0), so on
every one of the 96 steps rank 1 spends most of its time loading data while rank 0 sits in
the gradient all-reduce waiting for it.  The job finishes, just much slower than it should.

Root cause: rank 1 (persistent straggler; its extra time is data loading / augmentation in
`elastic_warp`, chosen by the rank-dependent policy).
Right diagnosis: straggler rank 1, the slow phase is data loading (the DataLoader's
__getitem__ -> elastic_warp), rank 0 waits in the all-reduce; the training loop would be about
2.5-3x faster if rank 1 kept up (measured here: ~2.7 s with the cheap policy on both ranks vs
~7.8 s as written, 96 steps, 2 CPU processes).
Fix: use the same augmentation policy on every rank (or sample the policy per tile, not per
rank), make the elastic warp cheaper, or move it to DataLoader workers (num_workers > 0).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["augment", "policy", "elastic", "data load", "dataloader", "num_workers", "worker",
            "input pipeline", "__getitem__"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

AUG_POLICIES = ["flip_crop", "elastic"]


def gaussian_kernel(size=21, sigma=4.0):
    ax = torch.arange(size, dtype=torch.float32) - size // 2
    k = torch.exp(-(ax ** 2) / (2 * sigma ** 2))
    k2 = torch.outer(k, k)
    return (k2 / k2.sum()).expand(2, 1, size, size).contiguous()


KERNEL = gaussian_kernel()


def flip_crop(img, g):
    if torch.rand((), generator=g) < 0.5:
        img = img.flip(-1)
    pad = F.pad(img.unsqueeze(0), (2, 2, 2, 2), mode="reflect")[0]
    i, j = torch.randint(0, 5, (2,), generator=g).tolist()
    return pad[:, i:i + 32, j:j + 32]


def elastic_warp(img, g, alpha=3.0, passes=3):
    img = flip_crop(img, g)
    disp = torch.rand(1, 2, 32, 32, generator=g) * 2 - 1
    for _ in range(passes):  # smooth the displacement field (fine, slow)
        disp = F.conv2d(F.pad(disp, (10, 10, 10, 10), mode="reflect"), KERNEL, groups=2)  # zoo: place
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 32), indexing="ij")
    grid = torch.stack([xs, ys], -1).unsqueeze(0) + alpha / 32 * disp.permute(0, 2, 3, 1)
    return F.grid_sample(img.unsqueeze(0), grid, align_corners=True)[0]


class TileDataset(Dataset):
    def __init__(self, n, policy, seed):
        g = torch.Generator().manual_seed(1234)
        self.labels = torch.randint(0, 6, (n,), generator=g)
        base = torch.randn(6, 3, 32, 32, generator=g)
        self.tiles = base[self.labels] + 0.8 * torch.randn(n, 3, 32, 32, generator=g)
        self.augment = {"flip_crop": flip_crop, "elastic": elastic_warp}[policy]
        self.g = torch.Generator().manual_seed(seed)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.augment(self.tiles[i], self.g), self.labels[i]


class TileNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 8 * 8, 6)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = AUG_POLICIES[rank % len(AUG_POLICIES)]  # "diverse augmentation per replica"  # zoo: place
    ds = TileDataset(3072, policy, seed=rank)
    sampler = DistributedSampler(ds, world, rank, shuffle=True)
    loader = DataLoader(ds, batch_size=32, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(TileNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        correct = 0
        for x, y in loader:
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct += (out.argmax(1) == y).sum().item()
        print(f"rank {rank} ({policy}) epoch {epoch} acc {correct / len(sampler):.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
