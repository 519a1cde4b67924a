"""The last rank renders preview reconstructions through the DDP wrapper (hang).

Story: a convolutional autoencoder (with BatchNorm) for 16x16 product thumbnails.  Rank 0 is
"busy enough" with logging, so the author gave the periodic preview job to the last rank:
every 20 steps `Trainer.render_previews()` runs on `rank == world - 1` only, switches to
eval mode and reconstructs a fixed batch of 8 thumbnails -- but it calls `self.model(...)`,
the DDP wrapper, not `self.model.module`.  With the default `broadcast_buffers=True`, a
DDP forward first broadcasts the BatchNorm buffers from rank 0, which is a collective, and
only rank 1 issues it.  In the middle of training this goes unnoticed: rank 1's extra
broadcast pairs with rank 0's buffer broadcast of the next training step, and because the
preview forward ran under `no_grad`, rank 1's own next training forward skips its buffer
sync, so the two ranks' sequences line up again.  But the last preview falls on the very last
step (120 = 3 epochs x 40 steps): rank 0 has no further forward and goes to the final
`dist.barrier()`, while rank 1 sits in the buffer broadcast inside `render_previews`.  The
job hangs at the end of training.

Root cause: rank 1 ran a forward through the DDP wrapper (buffer-sync collective) that rank 0
did not, in `render_previews` (called from the training loop on the last rank only).
Right diagnosis: hang; rank 1 is in the DDP forward's buffer broadcast in render_previews
(called from fit on the last rank only), rank 0 in the final barrier; the ranks issued a
different number of collectives because only rank 1 ran forwards through the wrapper.
Fix: render previews with the unwrapped model `self.model.module` (or run the preview forward
on every rank), or build DDP with broadcast_buffers=False.
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

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["model.module", ".module", "unwrapped", "every rank", "all ranks",
            "broadcast_buffers"],
    "names": [["render_previews", "preview"]],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


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
        self.model.eval()
        recon = torch.sigmoid(self.model(self.preview_batch))  # zoo: place
        self.model.train()
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
                    self.render_previews(step)  # zoo: place
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
