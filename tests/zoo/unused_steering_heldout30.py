"""End-to-end steering-angle regression from a front camera, DDP on CPU.

What the job does
    A small CNN trunk maps 3x48x64 dashcam frames (synthetic road renderings
    with lane markings bent by the steering angle) to a steering angle. The
    model also has an auxiliary speed head (multi-task regulariser); its loss
    weight comes from the run config and is set to 0.0 for this fleet because
    the CAN-bus speed labels are unreliable.

Root cause
    `compute_loss` only adds the speed term when `aux_speed_weight > 0`. With the
    weight at 0.0 the speed head's output never reaches the loss, so its weight
    and bias get no gradient. DDP (find_unused_parameters=False) waits for them
    in the first backward, and on the second forward every rank raises
    "Expected to have finished reduction in the prior iteration before starting
    a new one ... parameters that were not used in producing loss".

Fix
    Drop the speed head from the model when the auxiliary loss is disabled (or
    freeze it with requires_grad_(False)), or wrap with
    find_unused_parameters=True.

Observed (plain run)
    rc 1 after ~4 s. The first step completes; on the second forward (line
    `out = model(x)`) both ranks raise "RuntimeError: Expected to have finished
    reduction in the prior iteration before starting a new one. ... Parameter
    indices which did not receive grad for rank 0: 10 11" (same for rank 1;
    10 and 11 are speed_head.weight and speed_head.bias). torchrun names rank 0
    as the first failure.
"""
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = {
    "kind": ["unused_parameters"],
    "rank": None,
    "fix": ["find_unused_parameters", "speed_head", "remove the", "requires_grad", "freeze", "drop the"],
    "options": [],
}


@dataclass
class RunConfig:
    frames: int = 2048
    height: int = 48
    width: int = 64
    batch_size: int = 32
    epochs: int = 2
    lr: float = 3e-4
    aux_speed_weight: float = 0.0  # CAN speed labels unreliable on fleet B
    seed: int = 8


def render_frames(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    n, H, W = cfg.frames, cfg.height, cfg.width
    steer = (torch.rand(n, generator=g) - 0.5) * 0.8        # radians
    speed = 5 + 25 * torch.rand(n, generator=g)              # m/s
    ys = torch.linspace(0, 1, H).view(1, H, 1)               # 0 = horizon, 1 = bonnet
    xs = torch.linspace(-1, 1, W).view(1, 1, W)
    bend = steer.view(n, 1, 1) * (1 - ys) ** 2 * 1.5
    left = (xs - (-0.5 * ys + bend)).abs() < 0.04 + 0.02 * ys
    right = (xs - (0.5 * ys + bend)).abs() < 0.04 + 0.02 * ys
    road = (ys > 0.3).float().expand(n, H, W)
    frame = torch.stack([0.3 * road, 0.3 * road + 0.6 * (left | right).float(), 0.35 * road], dim=1)
    frame = frame + 0.05 * torch.randn(n, 3, H, W, generator=g)
    return frame, steer, speed


class DrivingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(3, 24, 5, stride=2, padding=2), nn.ELU(),
            nn.Conv2d(24, 36, 5, stride=2, padding=2), nn.ELU(),
            nn.Conv2d(36, 48, 3, stride=2, padding=1), nn.ELU(),
            nn.AdaptiveAvgPool2d((2, 2)), nn.Flatten(),
            nn.Linear(48 * 4, 64), nn.ELU(),
        )
        self.steer_head = nn.Linear(64, 1)
        self.speed_head = nn.Linear(64, 1)

    def forward(self, frames):
        h = self.trunk(frames)
        return {"steer": self.steer_head(h).squeeze(-1), "speed": self.speed_head(h).squeeze(-1)}


def compute_loss(out, steer, speed, cfg):
    loss = F.smooth_l1_loss(out["steer"], steer)
    if cfg.aux_speed_weight > 0:  # zoo: place
        loss = loss + cfg.aux_speed_weight * F.mse_loss(out["speed"], speed / 30.0)
    return loss


def main():
    cfg = RunConfig()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(cfg.seed)
    ckpt = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "steering", "drivingnet.pt")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)

    frames, steer, speed = render_frames(cfg, seed=cfg.seed)
    ds = TensorDataset(frames, steer, speed)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed)
    loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)

    model = DDP(DrivingNet())
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    step = 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for x, s, v in loader:
            out = model(x)
            loss = compute_loss(out, s, v, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step} steer_loss {loss.item():.4f}", flush=True)
    if rank == 0:
        torch.save(model.module.state_dict(), ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
