"""Click-through-rate prediction for a news-feed ranking service.

A factorisation-machine-style model (hashed embeddings for user segment, article topic,
slot position and hour, plus a dot-product interaction term) predicts clicks from impression
logs. Instead of a DistributedSampler, the logs are sharded by hashing the user id modulo the
world size -- the same routing the serving fleet uses -- and each rank iterates over its own
shard once per epoch. The hash puts the heavy "power users" on rank 0, so rank 1's shard is
about 30% shorter. Rank 1 runs out of batches first, finishes, and waits at the end-of-training
barrier; rank 0 is still training and blocks in DDP's gradient all-reduce for its next batch.

Root cause: shard_by_user() hash-partitions impressions, giving ranks different numbers of
batches per epoch; the rank with the short shard (rank 1) leaves the loop first.
Plain run (measured): shards of 7385 vs 5115 impressions (116 vs 80 batches); rank 1 prints
"rank 1 done: 80 steps" and the job is still alive after 60 s (killed by timeout, rc 124).
Fix: give every rank the same number of batches -- use a DistributedSampler (drop_last /
padding), truncate or pad the shards to equal length, or wrap the loop in the Join context
manager (model.join()).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

OUT = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
os.makedirs(OUT, exist_ok=True)

EXPECT = {
    "kind": ["uneven_inputs", "rank_left_early", "hang"],
    "rank": 1,
    "fix": [
        "distributedsampler",
        "sampler",
        "join",
        "equal",
        "same number",
        "pad",
        "truncate",
        "drop_last",
        "uneven",
        "balance",
        "shard",
        "min",
        "length",
        "batches",
    ],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

N_SEG, N_TOPIC, N_SLOT, N_HOUR = 40, 30, 10, 24
BUCKETS = 256


def synth_impressions(n, seed):
    g = torch.Generator().manual_seed(seed)
    # power users (low ids) produce many more impressions
    user = (torch.rand(n, generator=g) ** 2 * 5000).long()
    seg = user % N_SEG
    topic = torch.randint(0, N_TOPIC, (n,), generator=g)
    slot = torch.randint(0, N_SLOT, (n,), generator=g)
    hour = torch.randint(0, N_HOUR, (n,), generator=g)
    affinity = torch.sin(seg.float() * 0.7 + topic.float() * 1.3)
    logit = -1.5 + 1.2 * affinity - 0.25 * slot.float() + 0.3 * torch.cos(hour.float() / 24 * 6.28)
    click = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    feats = torch.stack([seg, N_SEG + topic, N_SEG + N_TOPIC + slot, N_SEG + N_TOPIC + N_SLOT + hour], 1)
    return user, feats, click


def shard_by_user(user, feats, click, rank, world):
    bucket = (user * 2654435761) % 4093 % BUCKETS
    mine = (bucket < BUCKETS * 0.59) if rank == 0 else (bucket >= BUCKETS * 0.59)  # zoo: place
    return feats[mine], click[mine]


class FM(nn.Module):
    def __init__(self, n_feat, k=8):
        super().__init__()
        self.lin = nn.Embedding(n_feat, 1)
        self.emb = nn.Embedding(n_feat, k)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, f):
        v = self.emb(f)
        inter = 0.5 * ((v.sum(1) ** 2) - (v**2).sum(1)).sum(1)
        return self.bias + self.lin(f).sum((1, 2)) + inter


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    user, feats, click = synth_impressions(12500, seed=4)
    f, c = shard_by_user(user, feats, click, rank, world)
    bs = 64
    n_batches = (len(f) + bs - 1) // bs
    print(f"rank {rank}: {len(f)} impressions, {n_batches} batches", flush=True)
    torch.manual_seed(0)
    model = DDP(FM(N_SEG + N_TOPIC + N_SLOT + N_HOUR))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    step = 0
    for b in range(n_batches):
        x, y = f[b * bs : (b + 1) * bs], c[b * bs : (b + 1) * bs]
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 20 == 0:
            print(f"rank {rank} step {step} logloss {loss.item():.4f}", flush=True)
    print(f"rank {rank} done: {step} steps", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(OUT, "ctr_fm.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
