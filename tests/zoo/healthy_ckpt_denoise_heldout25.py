"""Convolutional image denoiser with periodic rank-0 evaluation and checkpoints (2-rank DDP, gloo/CPU).

What the job does
-----------------
Synthetic 16x16 grey-scale "sprites" (Gaussian blobs and oriented stripes, seeded) are
corrupted with Gaussian noise (sigma 0.3) and a 4-layer CNN learns to predict the clean
image.  Data goes through a DistributedSampler with `set_epoch` every epoch.  Every 20
optimizer steps rank 0 -- and only rank 0 -- evaluates `model.module` under
`torch.no_grad()` on a fixed validation batch (PSNR) and writes a checkpoint to
tempfile.gettempdir()/ddpdoctor-zoo/denoise_ckpt/; all ranks then meet at a
`dist.barrier()` that sits *outside* the rank-0 branch.  At the end every rank reloads
the last checkpoint with map_location="cpu" and checks it matches its live weights.

Why it is healthy
-----------------
The rank-0-only work contains no collectives (it uses the unwrapped module, not the DDP
wrapper), the barrier is executed unconditionally by every rank at the same step, the
sampler is re-seeded each epoch, and the checkpoint is only read after the barrier that
follows the write.  Rank 0 does a little extra work every 20 steps, but it is small
compared with the training steps.

Observed (plain run, torchrun --nproc_per_node 2, OMP_NUM_THREADS=1)
--------------------------------------------------------------------
exit 0 after ~7-8 s, 5 epochs x 32 steps, 9 rank-0 evaluations/checkpoints.  Last lines:
    INFO step 160: val PSNR 21.07 dB, checkpoint -> /tmp/ddpdoctor-zoo/denoise_ckpt/latest.pt
    INFO rank 0: param sum 40.96581698 sq 37.30598951, checkpoint matches live weights: True
    INFO rank 1: param sum 40.96581698 sq 37.30598951, checkpoint matches live weights: True
    INFO replicas identical: True
(The model is deleted and garbage-collected before destroy_process_group: without that,
torch 2.13 + gloo occasionally aborted at interpreter exit with "terminate called without an
active exception" -- 1 of 8 runs of this job, 3-12 % of runs of a minimal DDP repro; 0 failures in 7 runs since.)
"""
import gc
import logging
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = None

SIZE = 16
SIGMA = 0.3


def make_sprites(n, seed):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(SIZE).float(), torch.arange(SIZE).float(), indexing="ij")
    cy, cx = SIZE * torch.rand(2, n, 1, 1, generator=g)
    r = 1.5 + 3.0 * torch.rand(n, 1, 1, generator=g)
    blobs = torch.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r ** 2))
    theta = math.pi * torch.rand(n, 1, 1, generator=g)
    freq = 0.3 + 0.5 * torch.rand(n, 1, 1, generator=g)
    stripes = 0.5 + 0.5 * torch.sin(freq * (xx * torch.cos(theta) + yy * torch.sin(theta)))
    kind = (torch.rand(n, 1, 1, generator=g) < 0.5).float()
    clean = (kind * blobs + (1 - kind) * stripes).unsqueeze(1)
    noisy = clean + SIGMA * torch.randn(clean.shape, generator=g)
    return noisy, clean


class Denoiser(nn.Module):
    def __init__(self, ch=24):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, ch, 3, padding=1), nn.ReLU(),
            nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU(),
            nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU(),
            nn.Conv2d(ch, 1, 3, padding=1),
        )

    def forward(self, x):
        return x - self.body(x)          # residual: predict the noise


class DenoiseJob:
    def __init__(self, rank, world, epochs=5, batch_size=32, ckpt_every=20):
        self.rank, self.world = rank, world
        self.epochs, self.ckpt_every = epochs, ckpt_every
        self.log = logging.getLogger("denoise")
        self.ckpt_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "denoise_ckpt")
        os.makedirs(self.ckpt_dir, exist_ok=True)
        self.ckpt_path = os.path.join(self.ckpt_dir, "latest.pt")

        noisy, clean = make_sprites(2048, seed=21)
        ds = TensorDataset(noisy, clean)
        self.sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5)
        self.loader = DataLoader(ds, batch_size=batch_size, sampler=self.sampler, drop_last=True)
        self.val_noisy, self.val_clean = make_sprites(128, seed=99)

        torch.manual_seed(0)
        self.model = DDP(Denoiser())
        self.opt = torch.optim.Adam(self.model.parameters(), lr=2e-3)
        self.step = 0

    def psnr(self):
        net = self.model.module
        net.eval()
        with torch.no_grad():
            mse = F.mse_loss(net(self.val_noisy), self.val_clean).item()
        net.train()
        return 10 * math.log10(1.0 / mse)

    def checkpoint(self, epoch):
        if self.rank == 0:
            score = self.psnr()
            torch.save({"step": self.step, "epoch": epoch, "model": self.model.module.state_dict(),
                        "opt": self.opt.state_dict()}, self.ckpt_path)
            self.log.info("step %d: val PSNR %.2f dB, checkpoint -> %s", self.step, score, self.ckpt_path)
        dist.barrier()

    def run(self):
        for epoch in range(self.epochs):
            self.sampler.set_epoch(epoch)
            for noisy, clean in self.loader:
                loss = F.mse_loss(self.model(noisy), clean)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()
                self.step += 1
                if self.step % self.ckpt_every == 0:
                    self.checkpoint(epoch)
            if self.rank == 0:
                self.log.info("epoch %d done at step %d, last loss %.5f", epoch, self.step, loss.item())
        self.checkpoint(self.epochs - 1)

    def verify(self):
        state = torch.load(self.ckpt_path, map_location="cpu")
        live = self.model.module.state_dict()
        same = all(torch.equal(state["model"][k], live[k]) for k in live)
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.module.parameters()]).double()
        mine = torch.stack([flat.sum(), (flat * flat).sum(), torch.tensor(float(same), dtype=torch.float64)])
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        if self.rank == 0:
            for r, v in enumerate(every):
                self.log.info("rank %d: param sum %.8f sq %.8f, checkpoint matches live weights: %s",
                              r, v[0].item(), v[1].item(), bool(v[2].item()))
            self.log.info("replicas identical: %s", all(torch.equal(every[0], v) for v in every))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    job = DenoiseJob(rank, world)
    job.run()
    job.verify()
    del job
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
