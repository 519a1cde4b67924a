"""Galaxy morphology classifier (elliptical / spiral / edge-on / irregular) trained with DDP + EMA.

Story
-----
A small CNN classifies 32x32 single-band galaxy cut-outs.  Like many vision recipes the job keeps
an exponential moving average (EMA) of the weights and reports validation accuracy of the EMA
weights.  To save time only rank 0 runs validation: it swaps the EMA weights into the live
model (`ema.copy_to`), evaluates, and should then put the training weights back
(`ema.restore`).

Root cause
----------
During a refactor the `ema.restore(...)` call ended up inside the "checkpoint every SAVE_EVERY
epochs" block, so after every validation that is not followed by a checkpoint, rank 0 keeps
training from the EMA weights while rank 1 keeps its own training weights.  DDP only broadcasts
parameters at construction time, so from then on the replicas silently drift apart - gradients
are still averaged, but they are applied to different weights.  No error, no hang.
Fix: always restore the training weights after EMA evaluation (try/finally), outside any
condition, or evaluate a separate EMA copy of the model instead of swapping weights in place.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): exit code 0 in ~9-10 s, no
warning or error; EMA val accuracy reaches 1.000 by epoch 4.  Final parameter checksums differ:
rank 0 105.4170285311 vs rank 1 115.0655633816 (identical across two runs).
"""
import copy
import logging
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": ["weights_diverged"],
    "rank": 0,
    "fix": ["ema", "restore"],
    "options": [],
}

CLASSES = ["elliptical", "spiral", "edge_on", "irregular"]
IMG = 32
EPOCHS = 5
BATCH = 64
SEED = 99
SAVE_EVERY = 2

log = logging.getLogger("galaxy")


def render_galaxies(n, seed):
    g = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, IMG), torch.linspace(-1, 1, IMG), indexing="ij")
    labels = torch.randint(0, len(CLASSES), (n,), generator=g)
    imgs = torch.empty(n, 1, IMG, IMG)
    for i in range(n):
        k = int(labels[i])
        ang = float(torch.rand(1, generator=g)) * math.pi
        ca, sa = math.cos(ang), math.sin(ang)
        u, v = ca * xs + sa * ys, -sa * xs + ca * ys
        if k == 0:
            img = torch.exp(-(u ** 2 / 0.12 + v ** 2 / 0.07))
        elif k == 1:
            r, th = torch.sqrt(u ** 2 + v ** 2), torch.atan2(v, u)
            img = torch.exp(-r / 0.35) * (1 + 0.8 * torch.cos(2 * th - 7 * r))
        elif k == 2:
            img = torch.exp(-(u ** 2 / 0.35 + v ** 2 / 0.006))
        else:
            c = torch.randn(3, 2, generator=g) * 0.4
            img = sum(torch.exp(-((xs - a) ** 2 + (ys - b) ** 2) / 0.03) for a, b in c.tolist())
        imgs[i, 0] = img + 0.08 * torch.randn(IMG, IMG, generator=g)
    return imgs, labels


class ConvBlock(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True), nn.MaxPool2d(2))


class GalaxyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(ConvBlock(1, 16), ConvBlock(16, 32), ConvBlock(32, 48))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(48 * 4 * 4, 64), nn.ReLU(),
                                  nn.Dropout(0.3), nn.Linear(64, len(CLASSES)))

    def forward(self, x):
        return self.head(self.stem(x))


class EMA:
    def __init__(self, params, decay=0.9):
        self.decay = decay
        self.shadow = [p.detach().clone() for p in params]
        self.backup = None

    @torch.no_grad()
    def update(self, params):
        for s, p in zip(self.shadow, params):
            s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    @torch.no_grad()
    def copy_to(self, params):
        self.backup = [p.detach().clone() for p in params]
        for s, p in zip(self.shadow, params):
            p.copy_(s)

    @torch.no_grad()
    def restore(self, params):
        for b, p in zip(self.backup, params):
            p.copy_(b)
        self.backup = None


def random_flip_rotate(x, g):
    if torch.rand(1, generator=g) < 0.5:
        x = x.flip(-1)
    return torch.rot90(x, int(torch.randint(0, 4, (1,), generator=g)), (-2, -1))


@torch.no_grad()
def evaluate(net, x, y):
    net.eval()
    acc = (net(x).argmax(1) == y).float().mean().item()
    net.train()
    return acc


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()  # noqa: F841
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED)

    x_tr, y_tr = render_galaxies(1536, SEED)
    x_va, y_va = render_galaxies(384, SEED + 1)
    ds = TensorDataset(x_tr, y_tr)
    sampler = DistributedSampler(ds, shuffle=True, seed=SEED)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, drop_last=True)

    model = DDP(GalaxyNet())
    params = list(model.module.parameters())
    ema = EMA(params)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    aug_gen = torch.Generator().manual_seed(SEED + 17 * rank)
    ckpt_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "galaxy_ho24")
    os.makedirs(ckpt_dir, exist_ok=True)
    best_acc = 0.0

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        t0, tot = time.time(), 0.0
        for xb, yb in loader:
            xb = random_flip_rotate(xb, aug_gen)
            loss = F.cross_entropy(model(xb), yb, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ema.update(params)
            tot += loss.item()

        if rank == 0:
            ema.copy_to(params)  # zoo: place
            val_acc = evaluate(model.module, x_va, y_va)
            log.info("epoch %d loss %.4f ema_val_acc %.3f (%.1fs)", epoch, tot / len(loader),
                     val_acc, time.time() - t0)
            if (epoch + 1) % SAVE_EVERY == 0:
                best_acc = max(best_acc, val_acc)
                torch.save({"ema_state": copy.deepcopy(model.module.state_dict()),
                            "epoch": epoch, "best_acc": best_acc},
                           os.path.join(ckpt_dir, f"ema_epoch{epoch}.pt"))
                ema.restore(params)
        dist.barrier()

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] param checksum {checksum:.10f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
