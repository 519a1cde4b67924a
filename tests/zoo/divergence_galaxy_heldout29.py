"""Galaxy morphology classification (elliptical / spiral / edge-on / irregular).

A small CNN classifies 20x20 synthetic survey cut-outs. Both the training and the
validation set are sharded with DistributedSampler. After every epoch the job
evaluates, then lets ReduceLROnPlateau halve the learning rate when the validation
loss stops improving.

Root cause: `evaluate()` returns the mean loss over the rank's *own* validation shard
and that local number is handed to `scheduler.step()`. The shards differ, so the
plateau detector fires at different epochs on different ranks; from then on the ranks
apply different learning rates to the same all-reduced gradients and the replicas
drift apart. No error, every rank exits 0.

Fix: all_reduce the validation loss sum and sample count across ranks and step the
scheduler on every rank with that global value.

Observed (plain run): exit 0 in ~8 s; rank 0 prints its own val loss and lr each epoch
(lr 0.08 -> 0.04 at epoch 3 -> 0.02 at epoch 6 -> 0.01 at epoch 9). Checked separately:
rank 1's local val loss (0.460 vs its best 0.484) counted as a plateau at epoch 4, so rank 1
halved its lr there while rank 0 did not; rank 1 ends at lr 0.005 vs rank 0's 0.01. At the
end every parameter tensor differs, max |diff| ~0.22 (head.3.bias), ~0.09 on conv weights.
"""
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": ["weights_diverged", "model_differs"], "rank": None,
          "fix": ["all_reduce", "scheduler", "global validation loss", "every rank"],
          "options": []}

SIZE = 20
N_CLASSES = 4


def render_galaxies(n, seed):
    g = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, SIZE), torch.linspace(-1, 1, SIZE), indexing="ij")
    r = torch.sqrt(xs ** 2 + ys ** 2)
    theta = torch.atan2(ys, xs)
    labels = torch.randint(0, N_CLASSES, (n,), generator=g)
    imgs = torch.empty(n, 1, SIZE, SIZE)
    for i in range(n):
        c = labels[i].item()
        rot = torch.rand(1, generator=g).item() * 6.28
        scale = 0.25 + 0.2 * torch.rand(1, generator=g).item()
        if c == 0:
            img = torch.exp(-(r / scale) ** 2)
        elif c == 1:
            arms = 0.5 + 0.5 * torch.cos(2 * (theta + rot) - 6 * r)
            img = torch.exp(-r / (scale + 0.1)) * arms
        elif c == 2:
            xr = xs * torch.cos(torch.tensor(rot)) + ys * torch.sin(torch.tensor(rot))
            yr = -xs * torch.sin(torch.tensor(rot)) + ys * torch.cos(torch.tensor(rot))
            img = torch.exp(-(xr / (scale * 2)) ** 2 - (yr / (scale * 0.3)) ** 2)
        else:
            blobs = torch.zeros(SIZE, SIZE)
            for _ in range(3):
                cx, cy = (torch.rand(2, generator=g) * 1.2 - 0.6).tolist()
                blobs += torch.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / 0.05)
            img = blobs
        imgs[i, 0] = img + 0.35 * torch.randn(SIZE, SIZE, generator=g)
    return imgs, labels


class MorphologyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, N_CLASSES))

    def forward(self, x):
        return self.head(self.features(x))


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    total, count = 0.0, 0
    for x, y in loader:
        total += F.cross_entropy(model(x), y, reduction="sum").item()
        count += y.numel()
    model.train()
    return total / max(count, 1)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()  # noqa: F841
    torch.manual_seed(11)

    x_tr, y_tr = render_galaxies(1024, seed=1)
    x_va, y_va = render_galaxies(160, seed=2)
    train_ds, val_ds = TensorDataset(x_tr, y_tr), TensorDataset(x_va, y_va)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=3)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=32, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=80, sampler=val_sampler)

    model = DDP(MorphologyCNN())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.08, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5,
                                                           patience=0, threshold=0.1)

    ckpt_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
    os.makedirs(ckpt_dir, exist_ok=True)
    best = float("inf")
    for epoch in range(10):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        val_loss = evaluate(model, val_loader)
        scheduler.step(val_loss)  # zoo: place
        if rank == 0:
            print(f"epoch {epoch}: val {val_loss:.4f} lr {optimizer.param_groups[0]['lr']:.4f}", flush=True)
            if val_loss < best:
                best = val_loss
                torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "galaxy_heldout29_best.pt"))

    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
