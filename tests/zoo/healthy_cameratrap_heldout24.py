"""Camera-trap species classifier (empty / deer / boar / fox / badger / bird), trained with DDP.

Story
-----
Motion-triggered camera traps produce small colour crops around the detected animal.  Images are
sharded by *camera site* (each site's images stay on one rank, so per-site normalisation
statistics can be computed locally), which means the ranks hold different numbers of images.
A compact ResNet-style CNN with BatchNorm is trained on 3x32x32 crops.

Why it looks suspicious but is healthy
--------------------------------------
* Shards are uneven (rank 1 holds 930 images, rank 0 790) and each rank iterates its own
  DataLoader - but before training the ranks agree on `steps_per_epoch` with an
  all_reduce(MIN) and every rank stops after exactly that many steps, so DDP's gradient
  all-reduces always pair up.
* Validation runs on rank 0 only, on `model.module` (the bare module, so no DDP collective is
  issued), while rank 1 simply waits at the barrier; BatchNorm buffers are untouched because the
  module is in eval mode.
* BatchNorm running statistics are kept consistent by DDP's default buffer broadcast from rank 0
  at every forward (after the very last local forward they differ by one local update, which is
  normal DDP behaviour; rank 0's copy is the one checkpointed).
Expected: exits 0, both ranks print the same parameter checksum.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): exit code 0 in ~9-14 s.
Rank 0 has 16 local batches, rank 1 has 19; both run 16 steps/epoch.  Parameter checksums equal
(184.8376803526 on both ranks); BN buffer checksums differ slightly (483.997 vs 485.360) because
of the last local forward, as explained above.
"""
import logging
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = None

SPECIES = ["empty", "deer", "boar", "fox", "badger", "bird"]
SITES = {"ridge": 420, "creek": 380, "meadow": 260, "pines": 300, "quarry": 150, "marsh": 210}
EPOCHS = 3
BATCH = 48
SEED = 8

log = logging.getLogger("cameratrap")


def synth_site(name, n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, len(SPECIES), (n,), generator=g)
    palette = torch.tensor([[0.3, 0.4, 0.3], [0.55, 0.4, 0.25], [0.25, 0.2, 0.2],
                            [0.8, 0.4, 0.1], [0.5, 0.5, 0.5], [0.6, 0.6, 0.8]])
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 32), indexing="ij")
    size = torch.tensor([0.0, 0.5, 0.4, 0.3, 0.3, 0.15])[y].view(n, 1, 1)
    cx = 0.4 * torch.randn(n, 1, 1, generator=g)
    cy = 0.4 * torch.randn(n, 1, 1, generator=g)
    blob = torch.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / (size ** 2 + 1e-3)) * (size > 0)
    background = 0.35 + 0.1 * torch.randn(n, 3, 1, 1, generator=g)
    img = background * (1 - blob.unsqueeze(1)) + palette[y].view(n, 3, 1, 1) * blob.unsqueeze(1)
    night = torch.rand(n, generator=g) < 0.3          # IR frames are grey and dark
    img[night] = img[night].mean(1, keepdim=True).expand(-1, 3, -1, -1) * 0.6
    img = img + 0.05 * torch.randn(img.shape, generator=g)
    return img, y


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        out = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(out)) + self.skip(x))


class TrapNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(16, 24, 2), BasicBlock(24, 32, 2))
        self.fc = nn.Linear(32, len(SPECIES))

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def site_normalise(img):
    return (img - img.mean((0, 2, 3), keepdim=True)) / img.std((0, 2, 3), keepdim=True)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED)

    names = sorted(SITES)
    mine = names[rank::world]
    parts = [synth_site(s, SITES[s], SEED + names.index(s)) for s in mine]
    x = torch.cat([site_normalise(p[0]) for p in parts])
    y = torch.cat([p[1] for p in parts])
    gen = torch.Generator().manual_seed(SEED + rank)
    train_dl = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=gen,
                          drop_last=True)

    # uneven shards: agree on the number of steps every rank will run
    steps = torch.tensor([len(train_dl)])
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    steps_per_epoch = int(steps)
    log.info("sites %s: %d images, %d local batches, running %d steps/epoch", mine, len(y),
             len(train_dl), steps_per_epoch)

    if rank == 0:
        vx, vy = synth_site("holdout", 400, SEED + 100)
        vx = site_normalise(vx)

    model = DDP(TrapNet())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=6e-3,
                                                total_steps=EPOCHS * steps_per_epoch)
    ckpt = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "trapnet_ho24.pt")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)

    for epoch in range(EPOCHS):
        t0, tot = time.time(), 0.0
        batches = iter(train_dl)
        for step in range(steps_per_epoch):  # noqa: B007
            xb, yb = next(batches)
            if torch.rand(1, generator=gen) < 0.5:
                xb = xb.flip(-1)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += loss.item()
        if rank == 0:
            net = model.module
            net.eval()
            with torch.no_grad():
                acc = (net(vx).argmax(1) == vy).float().mean().item()
            net.train()
            log.info("epoch %d loss %.4f holdout acc %.3f (%.1fs)", epoch, tot / steps_per_epoch,
                     acc, time.time() - t0)
            torch.save({"epoch": epoch, "model": net.state_dict()}, ckpt)
        dist.barrier()

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    bufsum = sum(b.detach().double().sum().item() for b in model.module.buffers())
    print(f"[rank {rank}] param checksum {checksum:.10f} buffer checksum {bufsum:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
