"""Human-pose keypoint heatmap regression.

A small fully-convolutional net predicts one heatmap per keypoint (head, shoulders,
hips) from 24x24 synthetic person crops. The main process keeps an exponential moving
average of the weights (ModelEMA, as in many detection code bases) for evaluation and
for the checkpoints it writes. The training recipe has an "EMA restart" at a fixed
epoch: the live weights are reset to the smoothed EMA weights and training continues
from there with a lower learning rate.

Root cause: the EMA exists only on rank 0 (`is_main`), and the restart is done inside
rank 0's end-of-epoch callback, so only rank 0's replica is overwritten with the EMA
weights. DDP does not re-broadcast parameters after construction, so from that epoch
on rank 0 trains a different model from rank 1. Both ranks exit 0.

Fix: keep the EMA on every rank (it is cheap) and do the restart on every rank, or
broadcast rank 0's parameters to all ranks (dist.broadcast) right after the copy.

Observed (plain run): exit 0 in ~10 s; rank 0 prints the EMA PCK (0.02 -> 0.28).
Checked separately: from the restart epoch on the replicas differ; at the end every conv
weight differs, max |diff| ~0.13 (body.4.weight), ~0.12 / ~0.10 on body.2 / body.0; the Adam
state is identical on both ranks (the gradients are still all-reduced).
"""
import copy
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": ["weights_diverged", "model_differs"], "rank": 0,
          "fix": ["every rank", "all ranks", "broadcast"],
          "options": []}

SIZE, N_KP = 24, 5
CFG = {"epochs": 6, "lr": 3e-3, "ema_decay": 0.98, "ema_restart_epoch": 3, "restart_lr_mult": 0.3}


def synth_people(n, seed):
    g = torch.Generator().manual_seed(seed)
    centre = torch.rand(n, 2, generator=g) * 8 + 8
    scale = torch.rand(n, 1, generator=g) * 2 + 3
    offsets = torch.tensor([[0, -2.0], [-1.2, -1.0], [1.2, -1.0], [-0.8, 1.5], [0.8, 1.5]])
    kps = centre[:, None, :] + offsets[None] * scale[:, :, None]
    yy, xx = torch.meshgrid(torch.arange(SIZE).float(), torch.arange(SIZE).float(), indexing="ij")
    d2 = (xx[None, None] - kps[..., 0, None, None]) ** 2 + (yy[None, None] - kps[..., 1, None, None]) ** 2
    heat = torch.exp(-d2 / 2.0)
    img = heat.sum(1, keepdim=True) * 0.8 + 0.3 * torch.randn(n, 1, SIZE, SIZE, generator=g)
    img = torch.cat([img, img.roll(1, dims=3)], dim=1)
    return img, heat


class KeypointNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(2, 24, 3, padding=1), nn.ReLU(),
            nn.Conv2d(24, 32, 3, padding=2, dilation=2), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        )
        self.heads = nn.Conv2d(32, N_KP, 1)

    def forward(self, x):
        return self.heads(self.body(x))


class ModelEMA:
    def __init__(self, model, decay):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(m.detach(), alpha=1 - self.decay)


@torch.no_grad()
def pck(model, x, heat, thr=2.0):
    pred = model(x).flatten(2).argmax(2)
    true = heat.flatten(2).argmax(2)
    py, px = pred // SIZE, pred % SIZE
    ty, tx = true // SIZE, true % SIZE
    return (((py - ty) ** 2 + (px - tx) ** 2).float().sqrt() < thr).float().mean().item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    is_main = rank == 0
    torch.manual_seed(3)

    x, heat = synth_people(1200, seed=9)
    x_val, heat_val = synth_people(200, seed=10)
    ds = TensorDataset(x, heat)
    sampler = DistributedSampler(ds, shuffle=True, seed=4)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, drop_last=True)

    model = DDP(KeypointNet())
    optimizer = torch.optim.Adam(model.parameters(), lr=CFG["lr"])
    ema = ModelEMA(model.module, CFG["ema_decay"]) if is_main else None

    out_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
    os.makedirs(out_dir, exist_ok=True)

    def on_epoch_end(epoch):
        if epoch == CFG["ema_restart_epoch"]:
            for group in optimizer.param_groups:
                group["lr"] *= CFG["restart_lr_mult"]
        if not is_main:
            return
        score = pck(ema.module, x_val, heat_val)  # noqa: F821
        print(f"epoch {epoch}: EMA PCK@2px {score:.3f}", flush=True)
        if epoch == CFG["ema_restart_epoch"]:
            model.module.load_state_dict(ema.module.state_dict())  # zoo: place  # noqa: F821
        torch.save({"epoch": epoch, "ema": ema.module.state_dict()},  # noqa: F821
                   os.path.join(out_dir, "posekeypoint_heldout29_ema.pt"))

    for epoch in range(CFG["epochs"]):
        sampler.set_epoch(epoch)
        for xb, hb in loader:
            loss = F.mse_loss(model(xb), hb) * 100
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if is_main:
                ema.update(model.module)
        on_epoch_end(epoch)

    dist.barrier()
    del model, ema
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
