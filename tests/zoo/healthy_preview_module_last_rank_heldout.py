"""Healthy twin of hang_preview_through_ddp_last_rank: previews use the unwrapped module.

Story: the BatchNorm autoencoder for product thumbnails; every 20 steps the last rank renders
reconstructions of a fixed preview batch.  `render_previews` calls `self.model.module` (the
plain nn.Module) in eval mode under no_grad, so it issues no collective and touches no DDP
state; rank 0 simply goes on with the next training step (it does not wait for the preview,
which is cheap).  The job trains 3 epochs (120 steps, 6 previews) and exits normally.

Right diagnosis: nothing wrong (no hang, no collective mismatch; the rank-1-only work is small).
"""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = None


def thumbnails(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    cx, cy = torch.rand(2, n, 1, 1, generator=g) * 10 + 3
    r = torch.rand(n, 1, 1, generator=g) * 4 + 2
    img = (((xx - cx) ** 2 + (yy - cy) ** 2) < r ** 2).float()
    return TensorDataset(img.unsqueeze(1) + 0.05 * torch.randn(n, 1, 16, 16, generator=g))


class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16),
                                 nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                                 nn.BatchNorm2d(32), nn.ReLU())
        self.dec = nn.Sequential(nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1),
                                 nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.ConvTranspose2d(16, 1, 4, stride=2, padding=1))

    def forward(self, x):
        return self.dec(self.enc(x))


class Trainer:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world
        torch.manual_seed(0)
        self.model = DDP(AutoEncoder())
        self.opt = torch.optim.Adam(self.model.parameters(), lr=2e-3)
        ds = thumbnails(2560)
        self.sampler = DistributedSampler(ds, world, rank, shuffle=True)
        self.loader = DataLoader(ds, batch_size=32, sampler=self.sampler)
        self.preview_batch = thumbnails(8, seed=99).tensors[0]
        self.preview_dir = tempfile.mkdtemp(prefix="ae-previews-") if rank == world - 1 else None

    @torch.no_grad()
    def render_previews(self, step):
        net = self.model.module  # plain module: no DDP buffer broadcast
        net.eval()
        recon = torch.sigmoid(net(self.preview_batch))
        net.train()
        grid = torch.cat([self.preview_batch, recon], 3).squeeze(1)
        torch.save(grid, os.path.join(self.preview_dir, f"step{step:05d}.pt"))

    def fit(self, epochs, preview_every=20):
        step = 0
        for epoch in range(epochs):
            self.sampler.set_epoch(epoch)
            for (x,) in self.loader:
                loss = F.binary_cross_entropy_with_logits(self.model(x), x.clamp(0, 1))
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                step += 1
                if step % preview_every == 0 and self.rank == self.world - 1:
                    self.render_previews(step)
            print(f"rank {self.rank} epoch {epoch} loss {loss.item():.4f}", flush=True)


def main():
    dist.init_process_group("gloo")
    trainer = Trainer(dist.get_rank(), dist.get_world_size())
    trainer.fit(epochs=3)
    dist.barrier()
    if trainer.preview_dir:
        shutil.rmtree(trainer.preview_dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
