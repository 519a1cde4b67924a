"""HEALTHY: a per-tensor gradient guard written as `register_hook` on every parameter, on every
rank, that clamps instead of raising.

Story: a small conv net on 3x12x12 synthetic patches.  Each parameter's hook replaces non-finite
entries with 0 (`nan_to_num`) and rescales the local gradient to a max norm of 1.0; it never
raises and costs the same on both ranks.  DDP then averages the clamped gradients.
DistributedSampler with set_epoch, 30 steps in total, then a barrier and a clean exit.

Right diagnosis: nothing to report (no warning, no error).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

MAX_NORM, STEPS = 1.0, 30


def clamp_grad(grad):
    grad = torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
    norm = grad.norm()
    return grad * (MAX_NORM / norm) if norm > MAX_NORM else grad


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(640, 3, 12, 12, generator=g)
    y = (x[:, 0, :6].mean((1, 2)) > x[:, 2, 6:].mean((1, 2))).long()
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=2)
    loader = DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
    net = nn.Sequential(nn.Conv2d(3, 12, 3), nn.ReLU(), nn.Conv2d(12, 12, 3, stride=2), nn.ReLU(),
                        nn.Flatten(), nn.Linear(12 * 4 * 4, 2))
    for p in net.parameters():
        p.register_hook(clamp_grad)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            if rank == 0 and step % 10 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            step += 1
            if step == STEPS:
                break
        epoch += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
