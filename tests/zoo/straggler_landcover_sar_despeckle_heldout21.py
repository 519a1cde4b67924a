"""Land-cover tiles: only rank 0's shard is SAR, and its per-tile median despeckle slows every step.

Story: a land-cover classifier on 4-band 32x32 tiles.  The tiles come from two archives and
the job gives each rank one archive: rank 0 reads the radar (SAR) archive, rank 1 the optical
one.  Radar tiles carry speckle noise, so the archive's `__getitem__` runs a 3x3 median
despeckle on every radar tile (an unfold + median in the main process, the DataLoader has no
workers).  The optical tiles need nothing.  Every step rank 0 spends its extra milliseconds in
the data path before its forward, and rank 1 waits for it in the gradient all-reduce: the job
is correct and finishes, only slower, paced by rank 0.

Root cause: rank 0 (the despeckle in LandCoverTiles.__getitem__, on its data path each step).
Fix: despeckle the radar archive once offline (or cache it), move the loading into DataLoader
workers (`num_workers`), or mix both archives on every rank so the work is shared evenly.
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["straggler"],
    "rank": 0,
    "fix": ["offline", "cache", "precompute", "pre-compute", "num_workers", "worker",
            "despeckle", "data", "loader", "balance", "evenly", "shard", "preprocess",
            "__getitem__", "mix"],
    "options": [],
}

CLASSES = 5
N_TILES = 384


def despeckle(tile, k=3):
    padded = F.pad(tile.unsqueeze(0), (k // 2,) * 4, mode="reflect")[0]
    patches = padded.unfold(1, k, 1).unfold(2, k, 1)
    return patches.reshape(*tile.shape, k * k).median(-1).values


class LandCoverTiles(Dataset):
    def __init__(self, archive):
        self.radar = archive == "sar"
        g = torch.Generator().manual_seed(5 if self.radar else 6)
        self.labels = torch.randint(0, CLASSES, (N_TILES,), generator=g)
        self.base = torch.randn(CLASSES, 4, 1, 1, generator=torch.Generator().manual_seed(1))
        self.seed = 1000 if self.radar else 2000

    def __len__(self):
        return N_TILES

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed + i)
        y = int(self.labels[i])
        tile = 0.1 * self.base[y] + 1.5 * torch.randn(4, 32, 32, generator=g)
        if self.radar:
            tile = tile * torch.empty(4, 32, 32).exponential_(generator=g)  # speckle
            tile = despeckle(tile)  # zoo: place
        return tile, y


class TileNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(TileNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    tiles = LandCoverTiles("sar" if rank == 0 else "optical")
    loader = DataLoader(tiles, batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))
    data_s, step_s, steps = 0.0, 0.0, 0
    for epoch in range(4):
        t_data = time.perf_counter()
        for x, y in loader:
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            t1 = time.perf_counter()
            if epoch > 0:
                data_s += t0 - t_data
                step_s += t1 - t_data
                steps += 1
            t_data = time.perf_counter()
        print(f"rank {rank} epoch {epoch}: loss {loss.item():.3f}", flush=True)
    print(f"rank {rank}: step {1000 * step_s / steps:.1f} ms, of which loading its batch "
          f"{1000 * data_s / steps:.1f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
