"""Card-transaction fraud scoring trained from daily shard files (2-rank DDP, gloo/CPU).

What the job does
-----------------
Rank 0 materialises five daily transaction files (synthetic, seeded; 16 engineered
features, ~2.5 % fraud, 1000-1400 rows per day) under
tempfile.gettempdir()/ddpdoctor-zoo/fraud_days/, then all ranks meet at a barrier.  Each
rank loads "its" days round-robin (`day_files[rank::world]`), trains an MLP with a
positive-class-weighted BCE loss in DDP, and at the end of every epoch rank 0 writes a
checkpoint while the others wait at a barrier.

Root cause
----------
Round-robin sharding by *file* gives rank 0 three days (4032 rows, 63 batches of 64) and
rank 1 two days (2304 rows, 36 batches).  Nothing evens this out and the loop does not
use `Join`, so rank 1 runs out of batches first and walks into the end-of-epoch
`dist.barrier()` while rank 0 is still training and blocks in DDP's gradient all-reduce
for its 37th batch.  Barrier vs. all-reduce never match: the job hangs in the first epoch.

Fix
---
Shard rows rather than files (concatenate the days and give each rank an equal slice, or a
DistributedSampler with drop_last=True), cap every rank at the minimum number of batches,
or wrap the loop in `torch.distributed.algorithms.join.Join([model])`.

Observed (plain run, torchrun --nproc_per_node 2, OMP_NUM_THREADS=1)
--------------------------------------------------------------------
exit 124 after the 90 s `timeout` (~0.1 s of training before the stall).  Last lines:
    [rank 0] days ['day_00.pt', 'day_02.pt', 'day_04.pt'] -> 4032 rows, 63 batches/epoch, fraud rate 2.852%
    [rank 1] days ['day_01.pt', 'day_03.pt'] -> 2304 rows, 36 batches/epoch, fraud rate 2.387%
    [rank 0] epoch 0 batch 30/63 loss 1.0131
    [rank 1] epoch 0 batch 30/36 loss 0.9562
    [rank 1] epoch 0 finished in 0.07s
py-spy while hung: rank 0 in loss.backward() (DDP all-reduce of batch 37), rank 1 in the
end-of-epoch dist.barrier().  Deterministic.
"""
import glob
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": ["uneven_inputs", "hang"], "rank": None, "fix": ["join", "shard", "day_files", "distributedsampler", "even", "drop_last"], "options": ["--hang-timeout", "6", "--on-hang", "kill"]}

DAY_ROWS = [1408, 1216, 1344, 1088, 1280]
N_FEAT = 16
BATCH = 64
EPOCHS = 3
DATA_ROOT = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "fraud_days")
CKPT = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "fraud_mlp_last.pt")


def write_day_files(root):
    os.makedirs(root, exist_ok=True)
    g = torch.Generator().manual_seed(8)
    w_true = torch.randn(N_FEAT, generator=g)
    for day, rows in enumerate(DAY_ROWS):
        x = torch.randn(rows, N_FEAT, generator=g)
        x[:, 0] = torch.log1p(torch.rand(rows, generator=g) * 500)       # amount
        x[:, 1] = (torch.rand(rows, generator=g) < 0.1).float()          # foreign merchant
        score = x @ w_true * 0.6 + 1.5 * x[:, 1] + 0.4 * (x[:, 0] - 4.0)
        y = (score + 0.5 * torch.randn(rows, generator=g) > 2.2).float()
        torch.save({"x": x, "y": y}, os.path.join(root, f"day_{day:02d}.pt"))


def load_days(paths):
    parts = [torch.load(p) for p in paths]
    return torch.cat([p["x"] for p in parts]), torch.cat([p["y"] for p in parts])


class FraudMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(N_FEAT, 64)
        self.fc2 = nn.Linear(64, 32)
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x))))).squeeze(-1)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        write_day_files(DATA_ROOT)
    dist.barrier()

    day_files = sorted(glob.glob(os.path.join(DATA_ROOT, "day_*.pt")))
    my_days = day_files[rank::world]  # zoo: place
    x, y = load_days(my_days)
    n_batches = len(x) // BATCH
    print(f"[rank {rank}] days {[os.path.basename(p) for p in my_days]} -> {len(x)} rows, "
          f"{n_batches} batches/epoch, fraud rate {y.mean():.3%}", flush=True)

    torch.manual_seed(0)
    model = DDP(FraudMLP())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pos_weight = torch.tensor(20.0)
    g = torch.Generator().manual_seed(rank)

    for epoch in range(EPOCHS):
        t0 = time.time()
        perm = torch.randperm(len(x), generator=g)
        running = 0.0
        for b in range(n_batches):
            idx = perm[b * BATCH:(b + 1) * BATCH]
            loss = F.binary_cross_entropy_with_logits(model(x[idx]), y[idx], pos_weight=pos_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += loss.item()
            if (b + 1) % 10 == 0:
                print(f"[rank {rank}] epoch {epoch} batch {b + 1}/{n_batches} loss {running / (b + 1):.4f}",
                      flush=True)
        print(f"[rank {rank}] epoch {epoch} finished in {time.time() - t0:.2f}s", flush=True)
        if rank == 0:
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict()}, CKPT)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
