"""Next-basket recommendation for an online grocery store.

A two-tower model (user tower + item tower, dot-product score, in-batch softmax) is trained on
a synthetic purchase log. Item SKUs are mapped to embedding rows through a catalogue index
built from the catalogue snapshot taken at the start of the quarter. The log is sharded by
time: rank 0 reads the older half, rank 1 the newer half. Halfway through rank 1's shard the
store introduced a seasonal product line whose SKUs are not in the snapshot.

Root cause: PurchaseLog.__getitem__ looks SKUs up with `self.sku_index[sku]`, which raises
KeyError on rank 1 when it reaches the first SKU that was added after the catalogue snapshot;
rank 1 dies mid-training while rank 0 waits in the gradient all-reduce.
Fix: map unknown SKUs to a reserved OOV/unknown embedding row (sku_index.get(sku, UNK)), or
rebuild the catalogue index from the full log / filter unseen items before training.
"""

import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

EXPECT = {
    "kind": ["rank_failure"],
    "rank": 1,
    "fix": [
        "unknown",
        "oov",
        "unseen",
        "missing",
        "catalog",
        "catalogue",
        "default",
        ".get",
        "keyerror",
        "vocabulary",
        "filter",
        "index",
        "reserved",
        "rebuild",
        "new sku",
    ],
    "options": [],
}

N_USERS = 400
BASE_SKUS = [f"SKU-{i:05d}" for i in range(600)]
SEASONAL_SKUS = [f"XMAS-{i:03d}" for i in range(40)]


def synth_log(n_events, seed):
    rng = random.Random(seed)
    events = []
    for t in range(n_events):
        user = rng.randrange(N_USERS)
        pool = BASE_SKUS
        if t > int(n_events * 0.78):
            pool = BASE_SKUS + SEASONAL_SKUS  # seasonal line launched late in the quarter
        sku = pool[(user * 7 + rng.randrange(60)) % len(pool)] if rng.random() < 0.9 else rng.choice(pool)
        events.append((t, user, sku))
    return events


class PurchaseLog(Dataset):
    def __init__(self, events, sku_index):
        self.events = events
        self.sku_index = sku_index

    def __len__(self):
        return len(self.events)

    def __getitem__(self, i):
        _, user, sku = self.events[i]
        item = self.sku_index[sku]  # zoo: place
        return torch.tensor(user), torch.tensor(item)


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, dim=32):
        super().__init__()
        self.user = nn.Sequential(nn.Embedding(n_users, dim), nn.Linear(dim, dim))
        self.item = nn.Sequential(nn.Embedding(n_items, dim), nn.Linear(dim, dim))

    def forward(self, u, i):
        return self.user(u) @ self.item(i).T / 0.1


def time_shard(events, rank, world):
    per = len(events) // world
    return events[rank * per : (rank + 1) * per]


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    events = synth_log(12000, seed=2024)
    sku_index = {sku: i for i, sku in enumerate(BASE_SKUS)}  # quarter-start catalogue snapshot
    shard = time_shard(events, rank, world)
    loader = DataLoader(PurchaseLog(shard, sku_index), batch_size=64, shuffle=False)
    torch.manual_seed(0)
    model = DDP(TwoTower(N_USERS, len(sku_index)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    t0 = time.time()
    for step, (u, i) in enumerate(loader):
        logits = model(u, i)
        loss = F.cross_entropy(logits, torch.arange(len(u)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(f"rank {rank} step {step} loss {loss.item():.3f} t={time.time() - t0:.1f}s", flush=True)
    print(f"rank {rank} finished {step + 1} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
