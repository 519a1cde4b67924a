"""Land-cover segmentation on synthetic multispectral satellite tiles.

Tiles come from two sensor generations: the archive (64 px native) and the new constellation
(320 px native). Every tile is rendered at native resolution, cloud-masked with a smoothing
filter, and resampled to the 32 px training grid inside the Dataset. The tile catalogue is
ordered by acquisition date, and `assign_tiles` gives each rank a contiguous block of it --
so rank 1 gets every new-constellation tile and does several times more preprocessing per
batch, while rank 0 idles in the gradient all-reduce every step. The job finishes, just slowly.

Root cause: assign_tiles() splits the date-ordered catalogue into contiguous blocks, so all
expensive high-resolution tiles land on rank 1, whose data loading is far slower each step
(persistent straggler).
Fix: interleave/shuffle the catalogue before sharding (round-robin or DistributedSampler with
shuffle) so preprocessing cost is balanced, or pre-resample tiles offline / add DataLoader
workers.
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

EXPECT = {
    "kind": ["straggler"],
    "rank": 1,
    "fix": [
        "balance",
        "shuffle",
        "interleave",
        "round-robin",
        "stride",
        "distributedsampler",
        "shard",
        "preprocess",
        "offline",
        "cache",
        "num_workers",
        "workers",
        "data loading",
        "even",
    ],
    "options": [],
}

BANDS = 4
GRID = 32
N_CLASSES = 5


def build_catalogue(n, seed):
    g = torch.Generator().manual_seed(seed)
    cat = []
    for k in range(n):
        new_sensor = k >= n // 2  # catalogue is in acquisition order; new constellation went live mid-way
        cat.append(
            {
                "tile": k,
                "native": 320 if new_sensor else 64,
                "seed": int(torch.randint(0, 2**31 - 1, (1,), generator=g)),
            }
        )
    return cat


def assign_tiles(catalogue, rank, world):
    per = len(catalogue) // world
    return catalogue[rank * per : (rank + 1) * per]  # zoo: place


def render_tile(entry):
    n = entry["native"]
    g = torch.Generator().manual_seed(entry["seed"])
    yy, xx = torch.meshgrid(torch.linspace(0, 1, n), torch.linspace(0, 1, n), indexing="ij")
    freq = 2 + 6 * torch.rand(BANDS, 2, generator=g)
    img = torch.stack(
        [torch.sin(freq[b, 0] * 6.28 * xx) * torch.cos(freq[b, 1] * 6.28 * yy) for b in range(BANDS)]
    )
    img = img + 0.2 * torch.randn(BANDS, n, n, generator=g)
    # cloud mask: smooth the brightness and threshold it (5x5 box filter, twice)
    k = torch.ones(1, 1, 5, 5) / 25.0
    bright = img.mean(0, keepdim=True)[None]
    for _ in range(2):
        bright = F.conv2d(bright, k, padding=2)
    img = img * (bright[0] < 0.35).float()
    x = F.interpolate(img[None], size=(GRID, GRID), mode="bilinear", antialias=True, align_corners=False)[0]
    label = (x[0] > 0).long() + (x[1] > 0).long() * 2
    return x, label.clamp(max=N_CLASSES - 1)


class Tiles(Dataset):
    def __init__(self, entries):
        self.entries = entries

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, i):
        return render_tile(self.entries[i])


class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(BANDS, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.mid = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(16, 16, 2, stride=2)
        self.out = nn.Conv2d(16 + BANDS, N_CLASSES, 1)

    def forward(self, x):
        h = self.up(self.mid(self.down(x)))
        return self.out(torch.cat([h, x], 1))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    catalogue = build_catalogue(960, seed=42)
    loader = DataLoader(
        Tiles(assign_tiles(catalogue, rank, world)),
        batch_size=6,
        shuffle=True,
        generator=torch.Generator().manual_seed(rank),
    )
    torch.manual_seed(0)
    model = DDP(TinyUNet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    data_t, step_t = 0.0, 0.0
    steps = 80
    it = iter(loader)
    t_start = time.time()
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = next(it)
        t1 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t2 = time.perf_counter()
        data_t += t1 - t0
        step_t += t2 - t1
        if step % 10 == 9:
            print(
                f"rank {rank} step {step + 1} loss {loss.item():.3f} data {1000 * data_t / (step + 1):.1f} ms/step "
                f"fwd+bwd+opt {1000 * step_t / (step + 1):.1f} ms/step",
                flush=True,
            )
    stats = torch.tensor([data_t, step_t])
    allstats = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(allstats, stats)
    if rank == 0:
        for r, s in enumerate(allstats):
            print(f"summary rank {r}: data {s[0]:.2f}s compute+wait {s[1]:.2f}s", flush=True)
        print(f"wall {time.time() - t_start:.1f}s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
