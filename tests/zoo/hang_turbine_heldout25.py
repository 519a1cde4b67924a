"""Vibration-window autoencoder for wind-turbine condition monitoring (2-rank DDP, gloo/CPU).

What the job does
-----------------
Each rank owns the accelerometer windows of "its" turbines (synthetic, seeded per rank):
two drivetrain tones plus sensor noise, 64 samples per window.  A small MLP autoencoder
is trained with Adam on reconstruction MSE.  After every epoch each rank scores its own
held-out windows (which contain some faulty, spiky windows), and whenever the validation
loss improves the job writes a "best" checkpoint from rank 0 and puts the ranks through a
barrier so that nobody races ahead while the file is being written.

Root cause
----------
The "did we improve?" decision is taken on the *local* validation loss of each rank (the
rank's own turbines), never reduced across ranks.  For the first epochs both ranks improve
together and both reach the barrier.  As soon as one rank's local loss improves while the
other's does not, only the improving rank enters `dist.barrier()`; the other rank skips the
branch, starts the next epoch and blocks in DDP's gradient all-reduce.  A barrier on one
rank and an all-reduce on the other never match, so the job hangs until the (30 min) gloo
timeout.

Fix
---
all_reduce the validation loss (average over ranks) before comparing it with `best_val`,
so every rank takes the same branch; or hoist the `dist.barrier()` out of the `if`.

Observed (plain run, torchrun --nproc_per_node 2, OMP_NUM_THREADS=1)
--------------------------------------------------------------------
exit 124 after the 90 s `timeout` (the job itself never ends; ~1 s of training before it
stalls).  Epochs 0-6: both ranks improve and pass the barrier together.  Epoch 7: rank 0's
local val 0.1001 < 0.1005 (improved), rank 1's 0.0956 > 0.0953 (not improved).  Last lines:
    [rank0] epoch 07 train 0.0706 val 0.1001 (0.06s)
    [rank1] epoch 07 train 0.0704 val 0.0956 (0.06s)
    [rank0] new best 0.1001, checkpoint written
py-spy while hung: rank 0 in dist.barrier() (the marked line), rank 1 in loss.backward()
(DDP gradient all-reduce) of epoch 8.  Deterministic across 3 runs.
"""
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

# The author named rank 0, the rank that entered the barrier. The zoo names the rank that went
# past a call every earlier round made (hang_rare_recall_skip_heldout17,
# hang_plankton_prototype_gather_skip_heldout21): both ranks made this barrier after the same
# steps in each of the seven epochs before; rank 1 went on without it (docs/diagnosis.md).
EXPECT = {"kind": ["rank_only_collective", "hang", "collective_mismatch"], "rank": 1, "fix": ["all_reduce", "barrier", "val_loss", "best_val"], "options": ["--hang-timeout", "6", "--on-hang", "kill"]}

WINDOW = 64
TRAIN_PER_RANK = 768
VAL_PER_RANK = 64
BATCH = 32
EPOCHS = 40

log = logging.getLogger("turbine-ae")


def synth_windows(n, seed, fault_rate=0.0):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(WINDOW, dtype=torch.float32)
    f1 = 0.04 + 0.03 * torch.rand(n, 1, generator=g)
    f2 = 3.0 * f1
    ph = 2 * math.pi * torch.rand(n, 2, generator=g)
    amp = 0.8 + 0.4 * torch.rand(n, 1, generator=g)
    x = amp * torch.sin(2 * math.pi * f1 * t + ph[:, :1]) + 0.3 * torch.sin(2 * math.pi * f2 * t + ph[:, 1:])
    x = x + 0.15 * torch.randn(n, WINDOW, generator=g)
    if fault_rate > 0:
        faulty = torch.rand(n, generator=g) < fault_rate
        spikes = (torch.rand(n, WINDOW, generator=g) < 0.05).float() * 2.0
        x = torch.where(faulty[:, None], x + spikes, x)
    return x


class WindowAE(nn.Module):
    def __init__(self, d=WINDOW, hidden=48, code=8):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, code))
        self.dec = nn.Sequential(nn.Linear(code, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x):
        return self.dec(self.enc(x))


@torch.no_grad()
def validation_loss(net, x):
    net.eval()
    loss = F.mse_loss(net(x), x).item()
    net.train()
    return loss


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(1234)

    x_train = synth_windows(TRAIN_PER_RANK, seed=100 + rank)
    x_val = synth_windows(VAL_PER_RANK, seed=900 + rank, fault_rate=0.1)

    model = DDP(WindowAE())
    opt = torch.optim.Adam(model.parameters(), lr=4e-3)
    ckpt_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "turbine_ae")
    os.makedirs(ckpt_dir, exist_ok=True)
    log.info("world=%d train=%d val=%d windows on this rank", world, len(x_train), len(x_val))

    best_val = float("inf")
    g = torch.Generator().manual_seed(7 + rank)
    steps = TRAIN_PER_RANK // BATCH
    for epoch in range(EPOCHS):
        t0 = time.time()
        perm = torch.randperm(TRAIN_PER_RANK, generator=g)
        running = 0.0
        for i in range(steps):
            xb = x_train[perm[i * BATCH:(i + 1) * BATCH]]
            loss = F.mse_loss(model(xb), xb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.item()
        val_loss = validation_loss(model.module, x_val)
        log.info("epoch %02d train %.4f val %.4f (%.2fs)", epoch, running / steps, val_loss, time.time() - t0)
        if val_loss < best_val:
            best_val = val_loss
            if rank == 0:
                torch.save({"epoch": epoch, "model": model.module.state_dict()},
                           os.path.join(ckpt_dir, "best.pt"))
                log.info("new best %.4f, checkpoint written", best_val)
            dist.barrier()  # zoo: place
    log.info("training finished, best val %.4f", best_val)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
