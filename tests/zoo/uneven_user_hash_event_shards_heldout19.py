"""Event logs sharded by user id hash give the ranks different batch counts -> rank 0 runs out.

Story: a click-through-rate model trained from the day's event logs.  The export job writes
one JSON-lines shard per rank, partitioned by `user_id % world_size` so that a user's events
stay together; each rank streams its own shard through a small generator pipeline
(`read_events` -> `featurize` -> `batched`, built on itertools.islice), no DataLoader.  Users
are not equally active, so the shards differ in length: rank 1 gets 654 events (11 batches),
rank 0 799 (13 batches).  When rank 1's stream ends it goes to the end-of-epoch
`dist.barrier()` (so that rank 0's checkpoint is complete before anyone starts the next
epoch), while rank 0 still has two batches left and waits in DDP's gradient all-reduce of its
12th step.  A barrier
and an all-reduce never pair: the job hangs at the end of epoch 0.

Root cause: rank 1 (it ran out of batches first; rank 0's extra steps have no partner).
Fix: equalise the work per rank: run the epoch under `model.join()` (DDP's Join context
manager), or cut every rank to the global minimum number of batches (all_reduce the count
with MIN first), or pad/rebalance the shards.
"""

import itertools
import json
import os
import random
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)

EXPECT = {
    "kind": ["uneven_inputs", "rank_left_early", "hang"],
    "rank": 1,
    "fix": ["join", "Join", "minimum", "min", "pad", "equal", "same number", "drop_last",
            "rebalance", "balance"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

N_USERS = 240
N_ITEMS = 500
BATCH = 64


def export_shard(path, rank, world):
    """What the nightly export writes: this rank's users, all their events."""
    rng = random.Random(2024)
    with open(path, "w") as f:
        for user in range(N_USERS):
            n_events = rng.choice([1, 2, 3, 5, 8, 13, 21])
            events = [(rng.randrange(N_ITEMS), rng.random()) for _ in range(n_events)]
            if user % world != rank:
                continue
            for item, u in events:
                clicked = int(u < 0.15 + 0.5 * ((item * 7 + user) % 11 == 0))
                f.write(json.dumps({"user": user, "item": item, "click": clicked}) + "\n")


def read_events(path):
    with open(path) as f:
        for line in f:
            yield json.loads(line)


def featurize(events):
    for e in events:
        yield e["user"], e["item"], float(e["click"])


def batched(rows, size):
    rows = iter(rows)
    while chunk := list(itertools.islice(rows, size)):
        users, items, clicks = zip(*chunk)
        yield torch.tensor(users), torch.tensor(items), torch.tensor(clicks)


class CTRModel(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.user = nn.Embedding(N_USERS, dim)
        self.item = nn.Embedding(N_ITEMS, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, users, items):
        return self.mlp(torch.cat([self.user(users), self.item(items)], -1)).squeeze(-1)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    workdir = tempfile.mkdtemp(prefix=f"ctr-rank{rank}-")
    shard = os.path.join(workdir, f"events-{rank:03d}.jsonl")
    export_shard(shard, rank, world)

    torch.manual_seed(0)
    model = DDP(CTRModel())
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)

    for epoch in range(3):
        total, steps = 0.0, 0
        for users, items, clicks in batched(featurize(read_events(shard)), BATCH):
            loss = F.binary_cross_entropy_with_logits(model(users, items), clicks)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
        print(f"[rank {rank}] epoch {epoch}: {steps} steps, loss {total / steps:.4f}", flush=True)
        dist.barrier()
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(workdir, f"ctr-{epoch}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
