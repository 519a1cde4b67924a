"""Healthy twin of the point-cloud straggler: same category-ordered export (small objects with
256 points, furniture with 2048), but the data is dealt by a shuffled DistributedSampler with
set_epoch every epoch, and the collate function resamples every cloud to 1024 points, so both
ranks do the same work every step.  Rank 0 saves one small checkpoint after the last epoch,
then all ranks meet at a barrier.

Near-misses a diagnosis should not flag: clouds of very different sizes in the dataset (equal
cost per batch after resampling), rank 0 alone writing a checkpoint (once, a few ms, at the
end), per-epoch logging on every rank, a final barrier.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

torch.set_num_threads(1)

EXPECT = None

SMALL = ["mug", "bottle", "lamp", "cup", "phone", "bowl", "can", "plant"]
LARGE = ["chair", "sofa", "table", "bed", "desk", "shelf", "cabinet", "bench"]
PER_CATEGORY = 60
N_POINTS = 1024
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


def resample_collate(items):
    clouds, labels = [], []
    for pts, label in items:
        n = pts.shape[1]
        idx = torch.randint(0, n, (N_POINTS,)) if n < N_POINTS else torch.randperm(n)[:N_POINTS]
        clouds.append(pts[:, idx])
        labels.append(label)
    return torch.stack(clouds), torch.tensor(labels)


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
    rank = dist.get_rank()
    data = ScanExport()
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True,
                        collate_fn=resample_collate)

    torch.manual_seed(0)
    model = DDP(PointNet(len(SMALL) + len(LARGE)))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        total, n = 0.0, 0
        for pts, labels in loader:
            loss = F.cross_entropy(model(pts), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            n += 1
        print(f"rank {rank} epoch {epoch} mean loss {total / n:.4f}", flush=True)

    if rank == 0:
        path = os.path.join(tempfile.gettempdir(), f"pointnet_{os.getpid()}.pt")
        torch.save(model.module.state_dict(), path)
        os.remove(path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
