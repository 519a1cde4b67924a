"""Flower species classification (10 species, 32x32 RGB), DDP on CPU.

What the job does
    Trains a small CNN on synthetic flower images (petal count, hue and centre
    size vary by species) with a DistributedSampler and set_epoch. Every
    LOG_EVERY steps rank 0 prints its local loss, the batch accuracy, the
    learning rate and its throughput.

Healthy: why it is correct
    The rank-0 block is pure local bookkeeping: loss.item(), an argmax over the
    current 32-sample batch and a print - a few milliseconds at most, no
    collective, no evaluation pass, no file I/O. Both ranks run the same number
    of steps and issue the same collectives in the same order; the other rank
    loses nothing measurable waiting for the print.

Observed (plain run)
    rc 0 in ~8 s, 80 steps over 2 epochs. Rank 0 prints every 10 steps, e.g.
    "ep 0 step   10 loss 2.2817 acc 0.156 lr 0.05 1598 img/s" ...
    "ep 1 step   80 loss 1.2418 acc 0.562 lr 0.05 1648 img/s"; throughput is
    flat across log steps. A copy that all_gathers the parameters at the end
    finds max |w_rank0 - w_rank1| = 0.0. No "terminate called" at exit.
"""
import gc
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = None

N_SPECIES = 10
LOG_EVERY = 10
EPOCHS = 2


class SynthFlowers(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, N_SPECIES, (n,), generator=g)
        self.phase = torch.rand(n, generator=g) * 2 * math.pi
        self.scale = 0.8 + 0.4 * torch.rand(n, generator=g)
        self.noise_seed = torch.randint(0, 2**31 - 1, (n,), generator=g)
        lin = torch.linspace(-1, 1, 32)
        yy, xx = torch.meshgrid(lin, lin, indexing="ij")
        self.r = torch.sqrt(xx ** 2 + yy ** 2)
        self.theta = torch.atan2(yy, xx)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        c = int(self.labels[i])
        petals = 3 + c % 5
        hue = torch.tensor([0.9 - 0.08 * c, 0.3 + 0.05 * c, 0.2 + 0.07 * (c % 4)])
        edge = self.scale[i] * (0.55 + 0.3 * torch.cos(petals * self.theta + self.phase[i]))
        petal = (self.r < edge).float()
        centre = (self.r < 0.12 + 0.02 * (c // 5)).float()
        img = petal.unsqueeze(0) * hue.view(3, 1, 1) + centre.unsqueeze(0) * torch.tensor([0.9, 0.8, 0.1]).view(3, 1, 1)
        g = torch.Generator().manual_seed(int(self.noise_seed[i]))
        img = img + 0.1 * torch.randn(3, 32, 32, generator=g)
        return img, c


class FlowerCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(64, N_SPECIES)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.manual_seed(0)
    out_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "flowers")
    os.makedirs(out_dir, exist_ok=True)

    ds = SynthFlowers(2560, seed=4)
    sampler = DistributedSampler(ds, shuffle=True, seed=4)
    loader = DataLoader(ds, batch_size=32, sampler=sampler)
    model = DDP(FlowerCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)

    step = 0
    t_last = time.perf_counter()
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for imgs, labels in loader:
            logits = model(imgs)
            loss = F.cross_entropy(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % LOG_EVERY == 0:
                now = time.perf_counter()
                acc = (logits.argmax(1) == labels).float().mean().item()
                ips = LOG_EVERY * len(labels) * world / (now - t_last)
                print(f"ep {epoch} step {step:4d} loss {loss.item():.4f} acc {acc:.3f} "
                      f"lr {opt.param_groups[0]['lr']:.3g} {ips:.0f} img/s", flush=True)
                t_last = now

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(out_dir, "flowercnn.pt"))
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
