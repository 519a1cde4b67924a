"""Length-grouped sampler hands all long sequences to the last rank -> straggler.

Story: to reduce padding, the user wrote `ContiguousLengthSampler`: it sorts the corpus
by sequence length and gives each rank one contiguous slice of the sorted list, then
shuffles inside the slice.  Every rank gets the same *number* of samples, so the epoch
length matches and nothing hangs -- but rank 1 receives the longest half of the corpus
(240-320 tokens vs. 10-60 on rank 0).  Its GRU forward/backward takes noticeably longer
every step and rank 0 spends that time waiting in DDP's gradient all-reduce.

Root cause: rank 1 (straggler: slower compute because of longer sequences).
Right diagnosis: rank 1 is consistently slow in forward/backward; rank 0 waits in the
all-reduce; the imbalance comes from the input pipeline.
Fix: balance the work across ranks -- interleave the length-sorted indices across ranks
(index i -> rank i % world_size) or bucket by length globally and deal buckets
round-robin, so each rank gets a similar token count.
"""

import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": [
        "sampler",
        "interleave",
        "balance",
        "bucket",
        "round-robin",
        "round robin",
        "shuffle",
        "token count",
        "sequence length",
        "equal work",
        "evenly",
    ],
    "options": [],
}


class Corpus(Dataset):
    def __init__(self, n=2048, seed=0):
        g = random.Random(seed)
        self.lengths = [g.choice([g.randint(10, 60), g.randint(240, 320)]) for _ in range(n)]
        self.seed = seed

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        L = self.lengths[i]
        return torch.randint(1, 500, (L,), generator=g), i % 3


def collate(items):
    L = max(t.numel() for t, _ in items)
    x = torch.zeros(len(items), L, dtype=torch.long)
    for k, (t, _) in enumerate(items):
        x[k, : t.numel()] = t
    y = torch.tensor([c for _, c in items])
    return x, y


class ContiguousLengthSampler(Sampler):
    """Sort by length, give each rank a contiguous slice -> little padding per batch."""

    def __init__(self, lengths, rank, world, seed=0):
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        per = len(order) // world
        self.indices = order[rank * per : (rank + 1) * per]
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        idx = list(self.indices)
        random.Random(self.seed + self.epoch).shuffle(idx)
        return iter(idx)

    def __len__(self):
        return len(self.indices)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(500, 32, padding_idx=0)
        self.rnn = nn.GRU(32, 64, batch_first=True)
        self.out = nn.Linear(64, 3)

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        return self.out(h.mean(1))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ds = Corpus()
    sampler = ContiguousLengthSampler(ds.lengths, rank, world)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, collate_fn=collate)
    model = DDP(Classifier())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    steps = 0
    for epoch in range(1):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if rank == 0 and steps % 20 == 0:
                print(f"step {steps} loss {loss.item():.3f}", flush=True)
            if steps == 60:
                break
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
