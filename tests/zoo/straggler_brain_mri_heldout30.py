"""Two-site brain MRI tumour / no-tumour slice classifier, DDP on CPU.

What the job does
    Slices come from two scanner sites. To keep each site's intensity
    normalisation self-contained, every rank trains on one site's slices
    ("site-stratified" sharding) at the site's native acquisition matrix; the
    fully-convolutional network ends in adaptive pooling so it accepts any
    matrix size. Both sites have the same number of slices, so the ranks run the
    same number of steps.

Root cause
    Site B was acquired on a 3T scanner with a 160x160 matrix, site A at 64x64.
    Because ranks are assigned whole sites, rank 1 pushes ~6x more pixels through
    the convolutions every step than rank 0, and rank 0 waits for it at every
    gradient all-reduce: a persistent straggler (rank 1).

Fix
    Resample all slices to a common matrix (e.g. 96x96) before training, or mix
    both sites in every rank's shard (DistributedSampler over the union) so the
    per-step work is balanced.

Observed (plain run)
    rc 0 in ~12 s. Rank 0 logs "training on site_a_1p5T (48 batches/epoch)",
    rank 1 "training on site_b_3T (48 batches/epoch)"; rank 0 prints
    "epoch 0 ... elapsed 3.5s" and "epoch 1 ... elapsed 7.1s" (96 steps, ~74
    ms a step). Timed single-process, a forward+backward on a batch of 8 costs
    ~10 ms at 64x64 (rank 0) and ~74 ms at 160x160 (rank 1), so rank 0 spends
    ~85% of every step waiting for rank 1 in the gradient all-reduce.
"""
import gc
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": ["straggler"],
    "rank": 1,
    "fix": ["resample", "resize", "common resolution", "interpolate", "mix", "balance", "DistributedSampler"],
    "options": [],
}

SITES = {
    "site_a_1p5T": {"matrix": 64, "n_slices": 384, "seed": 1},
    "site_b_3T": {"matrix": 160, "n_slices": 384, "seed": 2},
}
EPOCHS = 2
BATCH = 8


def phantom_slices(matrix, n, seed):
    """Ellipse 'brain' with optional bright tumour blob, per-site noise level."""
    g = torch.Generator().manual_seed(seed)
    lin = torch.linspace(-1, 1, matrix)
    yy, xx = torch.meshgrid(lin, lin, indexing="ij")
    a = 0.7 + 0.15 * torch.rand(n, 1, 1, generator=g)
    b = 0.8 + 0.15 * torch.rand(n, 1, 1, generator=g)
    brain = ((xx / a) ** 2 + (yy / b) ** 2 < 1).float()
    labels = (torch.rand(n, generator=g) < 0.5).long()
    cx = (torch.rand(n, 1, 1, generator=g) - 0.5) * 0.8
    cy = (torch.rand(n, 1, 1, generator=g) - 0.5) * 0.8
    r = 0.08 + 0.1 * torch.rand(n, 1, 1, generator=g)
    tumour = torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r ** 2))
    img = 0.6 * brain + 0.5 * tumour * labels.view(n, 1, 1).float() * brain
    img = img + 0.1 * torch.randn(n, matrix, matrix, generator=g)
    img = (img - img.mean(dim=(1, 2), keepdim=True)) / img.std(dim=(1, 2), keepdim=True)
    return img.unsqueeze(1), labels


class SliceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(64, 2)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


def site_loader(site, batch):
    cfg = SITES[site]
    x, y = phantom_slices(cfg["matrix"], cfg["n_slices"], cfg["seed"])
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(cfg["seed"]))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()  # noqa: F841
    torch.manual_seed(42)
    out_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "mri")
    os.makedirs(out_dir, exist_ok=True)

    site = sorted(SITES)[rank % len(SITES)]  # zoo: place
    loader = site_loader(site, BATCH)
    print(f"rank {rank}: training on {site} ({len(loader)} batches/epoch)", flush=True)

    model = DDP(SliceNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    t_start = time.time()
    for epoch in range(EPOCHS):
        correct = total = 0
        for x, y in loader:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            correct += (logits.argmax(1) == y).sum().item()
            total += len(y)
        if rank == 0:
            print(f"epoch {epoch} acc(site shard) {correct / total:.3f} "
                  f"elapsed {time.time() - t_start:.1f}s", flush=True)

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(out_dir, "slicenet.pt"))
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
