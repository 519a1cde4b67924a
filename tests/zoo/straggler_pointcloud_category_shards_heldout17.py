"""Point-cloud classifier whose dataset is split into contiguous halves by index, and the
export is ordered by category: rank 1 gets every dense furniture scan.

Story: a PointNet-style classifier (shared per-point MLP as 1x1 Conv1d 3->32->64->128, max
pool over points, then an MLP to 16 classes).  The scans were exported category by category:
the first half of the list are small tabletop objects (mugs, bottles, lamps ...) scanned with
256 points, the second half furniture (chairs, sofas, tables ...) with 2048 points each.  The
script shards "by hand" -- rank r takes indices [r*n, (r+1)*n) and shuffles within its shard
-- so rank 0 trains on small clouds only and rank 1 on the 8x larger ones.  Every step rank
1's forward and backward cost several times rank 0's; rank 0 waits for it in every gradient
all-reduce, for ~120 steps.  No error, the job is just slow (and each rank sees only half the
classes, but that is a separate matter).

Root cause: rank 1 (its shard holds the heavy clouds because of the contiguous split).
Right diagnosis: straggler, rank 1, time in forward/backward, its batches larger than rank 0's.
Fix: shard with a DistributedSampler (shuffled, interleaved) or a size-balanced sampler, so
every rank gets a mix of clouds.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset

torch.set_num_threads(1)

EXPECT = {
    "kind": "straggler",
    "rank": 1,
    "fix": ["DistributedSampler", "sampler", "shuffle", "balance", "shard", "interleav",
            "size", "points", "split"],
    "options": [],
}

SMALL = ["mug", "bottle", "lamp", "cup", "phone", "bowl", "can", "plant"]
LARGE = ["chair", "sofa", "table", "bed", "desk", "shelf", "cabinet", "bench"]
PER_CATEGORY = 60
BATCH = 16
EPOCHS = 4


class ScanExport(Dataset):
    """Scans in export order: category by category, small objects first."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.scans = []
        for label, name in enumerate(SMALL + LARGE):
            n_points = 256 if name in SMALL else 2048
            center = torch.randn(3, generator=g)
            scale = torch.rand(3, generator=g) + 0.5
            for _ in range(PER_CATEGORY):
                pts = center + scale * torch.randn(n_points, 3, generator=g)
                self.scans.append((pts.t().contiguous(), label))

    def __len__(self):
        return len(self.scans)

    def __getitem__(self, i):
        return self.scans[i]


class PointNet(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.point_mlp = nn.Sequential(
            nn.Conv1d(3, 32, 1), nn.ReLU(),
            nn.Conv1d(32, 64, 1), nn.ReLU(),
            nn.Conv1d(64, 128, 1), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, n_classes))

    def forward(self, pts):
        feats = self.point_mlp(pts)
        return self.head(feats.max(dim=2).values)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = ScanExport()
    per_rank = len(data) // world
    shard = Subset(data, range(rank * per_rank, (rank + 1) * per_rank))  # zoo: place
    loader = DataLoader(shard, batch_size=BATCH, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(rank))

    torch.manual_seed(0)
    model = DDP(PointNet(len(SMALL) + len(LARGE)))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    step = 0
    for epoch in range(EPOCHS):
        for pts, labels in loader:
            loss = F.cross_entropy(model(pts), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            step += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
