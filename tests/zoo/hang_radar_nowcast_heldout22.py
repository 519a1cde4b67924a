"""Precipitation nowcasting on synthetic radar sweeps.

A small conv net predicts the next radar reflectivity frame from the previous four. Frames are
generated in code: moving Gaussian rain cells advected by a constant wind field, plus clutter.
The team added a CheckpointManager that writes a snapshot every 20 steps; because the
snapshot is written by rank 0 only, someone added a barrier "so the other ranks don't read a
half-written file" -- but put it inside the rank-0 branch.

Root cause: CheckpointManager.maybe_save calls dist.barrier() inside `if self.rank == 0`, so
rank 0 waits in a barrier that rank 1 never enters; rank 1 runs on into the next step's
gradient all-reduce and both ranks wait forever.
Fix: move the barrier out of the rank-0 branch so every rank calls it (or drop it: nothing
reads the checkpoint during training).
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": ["rank_only_collective", "hang"],
    "rank": 0,
    "fix": [
        "barrier",
        "all ranks",
        "every rank",
        "both ranks",
        "outside",
        "move",
        "unconditional",
        "indent",
        "dedent",
        "rank 0",
        "collective",
        "remove the barrier",
        "all processes",
    ],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

H = W = 24
HISTORY = 4


def synth_sweeps(n_seq, seed):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(H).float(), torch.arange(W).float(), indexing="ij")
    seqs = []
    for _ in range(n_seq):
        n_cells = int(torch.randint(1, 4, (1,), generator=g))
        cx = torch.rand(n_cells, generator=g) * W
        cy = torch.rand(n_cells, generator=g) * H
        amp = 0.5 + torch.rand(n_cells, generator=g)
        wind = (torch.rand(2, generator=g) - 0.5) * 2.0
        frames = []
        for t in range(HISTORY + 1):
            f = torch.zeros(H, W)
            for c in range(n_cells):
                px = cx[c] + wind[0] * t
                py = cy[c] + wind[1] * t
                f += amp[c] * torch.exp(-((xx - px) ** 2 + (yy - py) ** 2) / 12.0)
            f += 0.05 * torch.rand(H, W, generator=g)  # ground clutter
            frames.append(f)
        seqs.append(torch.stack(frames))
    return torch.stack(seqs)  # [N, T+1, H, W]


class NowcastNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv2d(HISTORY, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()
        )
        self.head = nn.Conv2d(16, 1, 1)

    def forward(self, x):
        return self.head(self.enc(x)).squeeze(1)


class CheckpointManager:
    def __init__(self, model, rank, every, path="/tmp/ho22_radar_ckpt.pt"):
        self.model, self.rank, self.every, self.path = model, rank, every, path

    def maybe_save(self, step):
        if step == 0 or step % self.every:
            return
        if self.rank == 0:
            state = {"step": step, "model": self.model.module.state_dict()}
            torch.save(state, self.path)
            print(f"[ckpt] step {step} -> {self.path}", flush=True)
            dist.barrier()  # zoo: place


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(NowcastNet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    data = synth_sweeps(320, seed=100 + rank)
    ckpt = CheckpointManager(model, rank, every=20)
    bs = 8
    steps = 60
    t0 = time.time()
    for step in range(steps):
        i = (step * bs) % len(data)
        batch = data[i : i + bs]
        x, y = batch[:, :HISTORY], batch[:, HISTORY]
        pred = model(x)
        loss = F.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(f"rank {rank} step {step} loss {loss.item():.4f} t={time.time() - t0:.1f}s", flush=True)
        ckpt.maybe_save(step)
    dist.barrier()
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
