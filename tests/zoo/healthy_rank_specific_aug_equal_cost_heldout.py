"""Healthy: each rank uses a different, equally cheap augmentation of the same inputs.

Story: a 1-D signal classifier (64-sample windows -> Conv1d(1,8,5) -> pool -> Linear(8,4)).
For "augmentation diversity" the augmentation is picked by rank: rank 0 adds Gaussian jitter
(`x + N(0, 0.05)`), rank 1 applies a random per-sample gain (`x * N(1, 0.05)`).  Both
run in the Dataset's `__getitem__` (num_workers=0) and cost the same: one random draw of the
same size and one elementwise op per sample.  DistributedSampler + set_epoch, batch 8,
640 windows -> 40 steps per rank per epoch, 2 epochs = 80 steps of ~1-2 ms.  The data path
differs by rank but the work does not.

Right diagnosis: nothing to report (no warning, no error).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

torch.set_num_threads(1)

EXPECT = None


def jitter(x, g):
    noise = torch.empty_like(x).normal_(0.0, 0.05, generator=g)
    return x + noise


def gain(x, g):
    scale = torch.empty_like(x).normal_(1.0, 0.05, generator=g)
    return x * scale


AUGS = [jitter, gain]


class Windows(Dataset):
    def __init__(self, n, aug, seed):
        g = torch.Generator().manual_seed(8)
        self.y = torch.randint(0, 4, (n,), generator=g)
        t = torch.linspace(0, 1, 64)
        freq = (self.y.float() + 1).unsqueeze(1) * 3
        self.x = torch.sin(2 * torch.pi * freq * t) + 0.3 * torch.randn(n, 64, generator=g)
        self.aug = aug
        self.g = torch.Generator().manual_seed(seed)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.aug(self.x[i], self.g).unsqueeze(0), self.y[i]


class SignalNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 5, padding=2)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).amax(-1))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = Windows(640, AUGS[rank % len(AUGS)], seed=rank)
    sampler = DistributedSampler(data, seed=4)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(SignalNet())
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
