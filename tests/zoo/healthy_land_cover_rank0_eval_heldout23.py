"""Land-cover classification of multispectral satellite patches (healthy).

A small CNN with GroupNorm classifies 6-band 16x16 satellite patches into water, forest,
cropland, urban and bare soil. Each rank trains on its own tile set. Every 30 steps rank 0
alone scores a hold-out tile set and prints overall accuracy and per-class recall; rank 1 waits
at a barrier that both ranks call right after the rank-0 block. This looks like the textbook
"rank-0-only evaluation" hang, but evaluation goes through model.module (the bare module: no
DDP forward hooks, no buffer broadcast, no gradient all-reduce) in eval mode under
torch.no_grad(), so nothing in the model is modified and no collective is issued from the
rank-0-only path. The barrier is reached by every rank the same number of times.

Root cause: none (healthy job).
Plain run (measured): exits 0 in ~5 s; hold-out accuracy 0.851 -> 1.000; state_dict checksums
rank 0 343.065543 == rank 1 343.065543.
Fix: nothing to fix.
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None

CLASSES = ["water", "forest", "cropland", "urban", "bare"]
BANDS, PATCH = 6, 16
SIGNATURES = torch.tensor(
    [
        [0.05, 0.04, 0.03, 0.02, 0.01, 0.01],
        [0.03, 0.05, 0.04, 0.40, 0.20, 0.10],
        [0.06, 0.09, 0.08, 0.30, 0.28, 0.18],
        [0.15, 0.15, 0.16, 0.20, 0.25, 0.24],
        [0.20, 0.22, 0.25, 0.28, 0.35, 0.33],
    ]
)


def synth_patches(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, len(CLASSES), (n,), generator=g)
    x = SIGNATURES[y][:, :, None, None].expand(n, BANDS, PATCH, PATCH).clone()
    x += 0.05 * torch.randn(x.shape, generator=g)
    texture = torch.randn(n, 1, PATCH // 4, PATCH // 4, generator=g)
    x += (
        0.04
        * F.interpolate(texture, size=(PATCH, PATCH), mode="bilinear")
        * (y == 3).float()[:, None, None, None]
    )
    return x * 5, y


class LandCoverNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(BANDS, 16, 3, padding=1),
            nn.GroupNorm(4, 16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.GroupNorm(8, 32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, len(CLASSES))

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


@torch.no_grad()
def evaluate(net, x, y):
    was_training = net.training
    net.eval()
    pred = net(x).argmax(1)
    net.train(was_training)
    recall = [
        ((pred == c) & (y == c)).sum().item() / max((y == c).sum().item(), 1) for c in range(len(CLASSES))
    ]
    return (pred == y).float().mean().item(), recall


def state_checksum(module):
    return sum(v.double().abs().sum().item() for v in module.state_dict().values() if v.is_floating_point())


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, y = synth_patches(3000, seed=3 + rank)
    torch.manual_seed(0)
    model = DDP(LandCoverNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    if rank == 0:
        xh, yh = synth_patches(800, seed=4242)
    bs, t0 = 48, time.time()
    for step in range(1, 121):
        i = (step * bs) % (len(x) - bs)
        loss = F.cross_entropy(model(x[i : i + bs]), y[i : i + bs])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 30 == 0:
            if rank == 0:
                acc, recall = evaluate(model.module, xh, yh)
                rec = " ".join(f"{c}={r:.2f}" for c, r in zip(CLASSES, recall))
                print(
                    f"step {step} loss {loss.item():.3f} holdout acc {acc:.3f} [{rec}] t={time.time() - t0:.1f}s",
                    flush=True,
                )
            dist.barrier()
    print(f"rank {rank} state checksum {state_checksum(model.module):.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
