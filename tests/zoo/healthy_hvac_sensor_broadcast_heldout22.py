"""Fault detection for building HVAC units from multivariate sensor windows.

Each rank trains on the air-handling units of one building wing (supply/return temperature,
fan speed, damper position, valve command). Feature normalisation statistics are computed
once by rank 0 from a calibration week and shared with dist.broadcast -- every rank issues the
broadcast, rank 0 as source. The ranks use different but equally expensive augmentations
(rank-dependent branch with balanced cost), accumulate gradients over 4 micro-batches with
model.no_sync() on all but the last micro-batch, and rank 0 writes a checkpoint of
model.module.state_dict() that rank 1 reloads (map_location="cpu") after a barrier every rank
reaches. At the end the ranks compare parameter checksums: they are identical.

Root cause: none (healthy job).
Fix: nothing to fix.
"""

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None

N_SENS, WIN = 5, 32
CKPT = "/tmp/ho22_hvac_ckpt.pt"


def synth_wing(n, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(WIN).float()
    phase = torch.rand(n, 1, generator=g) * 6.28
    supply = 13 + 1.5 * torch.sin(t / 5 + phase)
    ret = 22 + 0.8 * torch.sin(t / 7 + phase)
    fan = 0.6 + 0.1 * torch.sin(t / 3 + phase)
    damper = 0.4 + 0.05 * torch.randn(n, WIN, generator=g)
    valve = 0.5 + 0.2 * torch.sin(t / 5 + phase)
    x = torch.stack([supply, ret, fan, damper, valve], 1)
    fault = torch.randint(0, 3, (n,), generator=g)  # 0 ok, 1 stuck damper, 2 leaking valve
    x[fault == 1, 3] = 0.95
    x[fault == 2, 0] += 3.0 * torch.linspace(0, 1, WIN)
    return x + 0.05 * torch.randn(x.shape, generator=g), fault


def shared_normalisation(rank):
    stats = torch.zeros(2, N_SENS)
    if rank == 0:
        calib, _ = synth_wing(2000, seed=123)
        stats[0] = calib.mean((0, 2))
        stats[1] = calib.std((0, 2))
    dist.broadcast(stats, src=0)
    return stats[0][None, :, None], stats[1][None, :, None]


def augment(x, rank, g):
    if rank % 2 == 0:  # wing A sensors drift: random offset
        return x + 0.05 * torch.randn(x.shape[0], N_SENS, 1, generator=g)
    return x * (1 + 0.05 * torch.randn(x.shape[0], N_SENS, 1, generator=g))  # wing B: gain error


class FaultNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(N_SENS, 32, 5, padding=2), nn.ReLU(), nn.Conv1d(32, 32, 5, padding=2), nn.ReLU()
        )
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.conv(x).mean(-1))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mean, std = shared_normalisation(rank)
    x, y = synth_wing(2048, seed=40 + rank)
    x = (x - mean) / std
    g = torch.Generator().manual_seed(1000 + rank)
    torch.manual_seed(0)
    model = DDP(FaultNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    accum, mb = 4, 16
    t0 = time.time()
    for step in range(40):
        opt.zero_grad()
        for k in range(accum):
            j = ((step * accum + k) * mb) % len(x)
            xb = augment(x[j : j + mb], rank, g)
            ctx = model.no_sync() if k < accum - 1 else contextlib.nullcontext()
            with ctx:
                loss = F.cross_entropy(model(xb), y[j : j + mb]) / accum
                loss.backward()
        opt.step()
        if step % 10 == 9:
            print(
                f"rank {rank} step {step + 1} loss {loss.item() * accum:.3f} t={time.time() - t0:.1f}s",
                flush=True,
            )
        if step == 19:
            if rank == 0:
                torch.save({"step": step, "model": model.module.state_dict()}, CKPT)
            dist.barrier()
            if rank == 1:
                state = torch.load(CKPT, map_location="cpu")
                diff = max(
                    (state["model"][k] - v).abs().max().item() for k, v in model.module.state_dict().items()
                )
                print(f"rank 1 reloaded checkpoint of step {state['step']}, max diff {diff:.2e}", flush=True)
    cs = torch.stack([p.detach().double().sum() for p in model.parameters()])
    out = [torch.zeros_like(cs) for _ in range(world)]
    dist.all_gather(out, cs)
    if rank == 0:
        print(
            "max |param checksum difference| across ranks:", (out[0] - out[1]).abs().max().item(), flush=True
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
