"""Freeway speed forecasting from loop detectors with uneven per-rank data under Join (2-rank DDP, gloo/CPU).

What the job does
-----------------
Each rank owns a set of freeway corridors (synthetic, seeded): 5-minute speed / flow /
occupancy readings with daily rush-hour dips.  Windows of 12 readings predict the speed
of the next 3 intervals.  Corridors are assigned to ranks whole, so rank 0 ends up with
more windows (40 batches per epoch) than rank 1 (28 batches).  An MLP forecaster is
trained with plain SGD in DDP; each epoch's training loop is wrapped in
`torch.distributed.algorithms.join.Join([model])`, and after the Join block every rank
evaluates its own validation windows and the error sums are all-reduced for logging.

Why it is healthy
-----------------
The ranks really do get different numbers of batches, but `Join` makes the rank that runs
out first shadow DDP's gradient all-reduces until everyone is done, and at the end of the
Join block DDP re-broadcasts the final parameters from the last rank to join, so replicas
stay identical.  No other collective is issued inside the Join block; the metric
all_reduce happens after it, on every rank.  Plain SGD (no momentum state) keeps the
per-rank optimizer state trivially consistent.

Observed (plain run, torchrun --nproc_per_node 2, OMP_NUM_THREADS=1)
--------------------------------------------------------------------
exit 0 after ~7-9 s, 25 epochs; every epoch rank 0 runs 40 local steps and rank 1 runs 28
(2502 vs 1791 training windows).  Last lines:
    [rank 0] epoch 24: 40 local steps in 0.13s, global val RMSE 2.81 mph MAE 2.28 mph
    [rank 1] epoch 24: 28 local steps in 0.13s, global val RMSE 2.81 mph MAE 2.28 mph
    rank 0: param sum 5.74298422 sq 174.46551272
    rank 1: param sum 5.74298422 sq 174.46551272
    replicas identical: True
"""
import gc
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None

HISTORY, HORIZON = 12, 3
BATCH = 64
EPOCHS = 25
CORRIDORS = {0: [("I-5 N", 920), ("I-405 S", 860), ("SR-99", 1000)],
             1: [("I-90 E", 1000), ("SR-520", 990)]}


def corridor_series(name, n_windows, seed):
    g = torch.Generator().manual_seed(seed)
    T = n_windows + HISTORY + HORIZON
    t = torch.arange(T, dtype=torch.float32)
    tod = (t % 288) / 288.0                                    # time of day, 5-min slots
    rush = torch.exp(-((tod - 0.33) / 0.04) ** 2) + 0.8 * torch.exp(-((tod - 0.72) / 0.05) ** 2)
    free_flow = 62 + 6 * torch.rand(1, generator=g)
    speed = free_flow * (1 - 0.55 * rush) + 2.5 * torch.randn(T, generator=g)
    flow = 1400 * rush + 300 + 60 * torch.randn(T, generator=g)
    occ = 0.05 + 0.25 * rush + 0.01 * torch.randn(T, generator=g)
    feats = torch.stack([(speed - 50) / 15, (flow - 900) / 500, (occ - 0.15) / 0.1], 1)
    X = torch.stack([feats[i:i + HISTORY].reshape(-1) for i in range(n_windows)])
    Y = torch.stack([(speed[i + HISTORY:i + HISTORY + HORIZON] - 50) / 15 for i in range(n_windows)])
    return X, Y


def load_my_corridors(rank):
    xs, ys = [], []
    for k, (name, n) in enumerate(CORRIDORS[rank]):
        X, Y = corridor_series(name, n, seed=1000 * rank + k)
        xs.append(X)
        ys.append(Y)
    X, Y = torch.cat(xs), torch.cat(ys)
    n_val = len(X) // 10
    return (X[n_val:], Y[n_val:]), (X[:n_val], Y[:n_val])


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    (x_tr, y_tr), (x_val, y_val) = load_my_corridors(rank)
    n_batches = math.ceil(len(x_tr) / BATCH)
    print(f"[rank {rank}] corridors {[c for c, _ in CORRIDORS[rank]]}: {len(x_tr)} windows, "
          f"{n_batches} batches/epoch", flush=True)

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(HISTORY * 3, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                              nn.Linear(256, HORIZON)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()
    g = torch.Generator().manual_seed(50 + rank)

    for epoch in range(EPOCHS):
        t0 = time.time()
        perm = torch.randperm(len(x_tr), generator=g)
        steps = 0
        with Join([model]):
            for b in range(n_batches):
                idx = perm[b * BATCH:(b + 1) * BATCH]
                loss = loss_fn(model(x_tr[idx]), y_tr[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                steps += 1
        with torch.no_grad():
            err = model.module(x_val) - y_val
        stats = torch.tensor([err.pow(2).sum().item(), err.abs().sum().item(), float(err.numel())],
                             dtype=torch.float64)
        dist.all_reduce(stats)
        rmse_mph = 15 * math.sqrt(stats[0].item() / stats[2].item())
        mae_mph = 15 * stats[1].item() / stats[2].item()
        print(f"[rank {rank}] epoch {epoch}: {steps} local steps in {time.time() - t0:.2f}s, "
              f"global val RMSE {rmse_mph:.2f} mph MAE {mae_mph:.2f} mph", flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]).double()
    mine = torch.stack([flat.sum(), (flat * flat).sum()])
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        for r, v in enumerate(every):
            print(f"rank {r}: param sum {v[0]:.8f} sq {v[1]:.8f}", flush=True)
        print(f"replicas identical: {all(torch.equal(every[0], v) for v in every)}", flush=True)
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
