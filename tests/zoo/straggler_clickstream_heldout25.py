"""Purchase-intent prediction from e-commerce click sessions with a GRU (2-rank DDP, gloo/CPU).

What the job does
-----------------
6144 synthetic browsing sessions (item-id sequences, log-normal lengths 3..220 clicks)
are labelled "purchase / no purchase".  To keep padding low the preprocessing sorts the
sessions by length and cuts them into fixed-size length buckets; each rank then takes a
contiguous slice of the sorted list, shuffles its bucket order every epoch and trains an
Embedding + GRU + linear head (packed sequences) wrapped in DDP.  The loop logs forward
time and full step time every 12 steps, and the mean per-rank times at the end.

Root cause
----------
Sharding is done on the *sorted* session list with a contiguous slice, so rank 0 receives
all the short sessions and rank 1 all the long ones (every one of rank 1's sessions is at
least as long as the longest of rank 0's).  GRU cost is proportional to the number of
clicks, so rank 1's forward/backward is several times slower on every single step; rank 0
finishes its compute early and sits in DDP's all-reduce waiting for rank 1.  The job is
otherwise correct (gradients are averaged, weights stay in sync) -- it is just slow.

Fix
---
Shard before sorting, or interleave the sorted list (`sessions[rank::world]`), or use a
DistributedSampler / length-bucketing sampler that gives every rank the same length mix.

Observed (plain run, torchrun --nproc_per_node 2, OMP_NUM_THREADS=1)
--------------------------------------------------------------------
exit 0 after ~9-10 s, 144 steps (3 epochs x 48 batches).  Rank 0 has 39 236 clicks,
rank 1 112 965 (2.9x).  Forward time per step: rank 0 ~2.8-3.3 ms, rank 1 ~6.1-7.0 ms; the
full synchronised step time is the same on both (~31-35 ms) because rank 0 waits in the
all-reduce.  Measured without DDP on the same shards, one full step (fwd+bwd+Adam) costs
~9.5 ms for rank 0's batches vs ~39 ms for rank 1's (about 4x).  Last lines:
    summary rank 0: mean fwd 2.8 ms, mean step 31.2 ms over 144 steps
    summary rank 1: mean fwd 6.1 ms, mean step 31.2 ms over 144 steps
"""
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence

EXPECT = {"kind": ["straggler"], "rank": 1, "fix": ["sort", "slice", "shard", "interleave", "distributedsampler", "bucket"], "options": []}

N_SESSIONS = 6144
N_ITEMS = 400
PROMO_ITEMS = 24
EMB, HID = 32, 96
BATCH = 64
EPOCHS = 3


def generate_sessions(n, seed=11):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(3.0 + 0.65 * torch.randn(n, generator=g)).round().clamp(3, 220).long()
    sessions, labels = [], []
    for L in lengths.tolist():
        s = torch.randint(1, N_ITEMS, (L,), generator=g)
        tail = s[-8:]
        intent = (tail <= PROMO_ITEMS).float().mean() + 0.02 * (s[:L // 2] <= PROMO_ITEMS).float().sum()
        sessions.append(s)
        labels.append(float(intent > 0.1))
    labels = torch.tensor(labels)
    flip = torch.rand(n, generator=g) < 0.05
    labels = torch.where(flip, 1 - labels, labels)
    return sessions, labels


class SessionGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(N_ITEMS, EMB, padding_idx=0)
        self.gru = nn.GRU(EMB, HID, batch_first=True)
        self.out = nn.Linear(HID, 1)

    def forward(self, padded, lengths):
        packed = pack_padded_sequence(self.emb(padded), lengths, batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return self.out(h[-1]).squeeze(-1)


def collate(sessions, labels, idx):
    seqs = [sessions[i] for i in idx]
    lengths = torch.tensor([len(s) for s in seqs])
    return pad_sequence(seqs, batch_first=True), lengths, labels[idx]


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])

    sessions, labels = generate_sessions(N_SESSIONS)
    # sort by length so that batches need little padding
    order = sorted(range(len(sessions)), key=lambda i: len(sessions[i]))
    sessions = [sessions[i] for i in order]
    labels = labels[order]
    per_rank = len(sessions) // world
    my_sessions = sessions[rank * per_rank:(rank + 1) * per_rank]  # zoo: place
    my_labels = labels[rank * per_rank:(rank + 1) * per_rank]
    buckets = [torch.arange(i, min(i + BATCH, per_rank)) for i in range(0, per_rank, BATCH)]
    n_clicks = sum(len(s) for s in my_sessions)
    print(f"[rank {rank}] {len(my_sessions)} sessions, {n_clicks} clicks, {len(buckets)} batches/epoch",
          flush=True)

    torch.manual_seed(0)
    model = DDP(SessionGRU())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1000 + rank)

    fwd_times, step_times = [], []
    step = 0
    for epoch in range(EPOCHS):
        for b in torch.randperm(len(buckets), generator=g).tolist():
            padded, lengths, y = collate(my_sessions, my_labels, buckets[b])
            t0 = time.perf_counter()
            logits = model(padded, lengths)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            t1 = time.perf_counter()
            opt.zero_grad()
            loss.backward()
            opt.step()
            t2 = time.perf_counter()
            fwd_times.append(t1 - t0)
            step_times.append(t2 - t0)
            step += 1
            if step % 12 == 0:
                print(f"[rank {rank}] epoch {epoch} step {step:3d} loss {loss.item():.4f} "
                      f"fwd {1e3 * (t1 - t0):6.1f} ms step {1e3 * (t2 - t0):6.1f} ms", flush=True)

    mean_fwd = sum(fwd_times) / len(fwd_times)
    mean_step = sum(step_times) / len(step_times)
    stats = torch.tensor([mean_fwd, mean_step], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    if rank == 0:
        for r, s in enumerate(gathered):
            print(f"summary rank {r}: mean fwd {1e3 * s[0]:.1f} ms, mean step {1e3 * s[1]:.1f} ms "
                  f"over {step} steps", flush=True)
    del model
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
