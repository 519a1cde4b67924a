"""Only rank 0 built its token cache; rank 1 tokenizes raw text in its collate_fn every step
(short-step straggler).

Story: a fastText-style review classifier (hashed word + character-trigram ids ->
EmbeddingBag(2048, 16, mode="mean") -> Linear(16, 3)), batch 12 reviews of 50-70 words
per rank, 60 steps, 1-3 ms per step when both ranks read cached ids.  Each rank reads its own
shard of reviews.  `prepare_shard_cache()` tokenizes a shard once and keeps the ids, but the call was
wrapped in `if rank == 0:` when the script was adapted from a single-process notebook ("only
the main process prepares data"), so only rank 0's shard has a cache.  Rank 1's `ReviewShard`
silently falls back to raw text, and `collate_reviews` tokenizes it on the fly: lower-casing,
a regex split and Python-side hashing of every word and every character trigram -- roughly
1-1.5 ms of extra host work in data loading on every step (num_workers=0, so in the
training process).  Rank 0 then waits for rank 1 in every gradient all-reduce.  No error, the
job is just slower than it should be.

Root cause: rank 1 (extra per-step work in data loading: tokenization in the collate_fn).
Right diagnosis: straggler, rank 1, the time is spent fetching/collating the batch (data
loading), not in forward/backward; rank 0 waits in the all-reduce.
Fix: build the token cache on every rank (or tokenize offline), or move tokenization into
DataLoader workers (num_workers > 0).
"""

import re
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)

EXPECT = {
    "kind": "straggler",
    "rank": 1,
    "fix": ["collate", "token", "data load", "dataloader", "num_workers", "worker", "cache",
            "preprocess", "input pipeline", "loader"],
    "options": [],
}

BUCKETS = 2048
BATCH = 12
STEPS = 60
WORDS = ["great", "terrible", "battery", "screen", "fast", "slow", "shipping", "broke", "love", "hate", "works", "fine", "awful", "refund", "excellent", "cheap", "sturdy", "flimsy", "quiet", "noisy", "bright", "dim", "charger", "cable", "return", "again", "recommend", "never", "always", "product", "seller", "arrived", "late", "early", "perfect"]
TOKEN_RE = re.compile(r"[a-z']+")


def make_reviews(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        label = int(torch.randint(0, 3, (), generator=g))
        k = int(torch.randint(50, 70, (), generator=g))
        idx = torch.randint(0, len(WORDS), (k,), generator=g).tolist()
        words = [WORDS[(j + 11 * label) % len(WORDS)] for j in idx]
        out.append((" ".join(words).capitalize() + "!", label))
    return out


def tokenize(text):
    ids = []
    for word in TOKEN_RE.findall(text.lower()):
        ids.append(zlib.crc32(word.encode()) % BUCKETS)
        padded = f"<{word}>"
        for i in range(len(padded) - 2):
            ids.append(zlib.crc32(padded[i:i + 3].encode()) % BUCKETS)
    return ids


def prepare_shard_cache(shard):
    shard.cached = [(torch.tensor(tokenize(text)), label) for text, label in shard.reviews]


class ReviewShard(Dataset):
    def __init__(self, rank):
        self.reviews = make_reviews(BATCH * STEPS, seed=1000 + rank)
        self.cached = None

    def __len__(self):
        return len(self.reviews)

    def __getitem__(self, i):
        if self.cached is not None:
            return self.cached[i]
        return self.reviews[i]  # raw text; collate_reviews tokenizes it


def collate_reviews(items):
    ids, offsets, labels = [], [0], []
    for content, label in items:
        if isinstance(content, str):  # raw text: no token cache for this shard
            content = torch.tensor(tokenize(content))  # zoo: place
        toks = content
        ids.append(toks)
        offsets.append(offsets[-1] + len(toks))
        labels.append(label)
    return torch.cat(ids), torch.tensor(offsets[:-1]), torch.tensor(labels)


class FastTextClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(BUCKETS, 16, mode="mean")
        self.fc = nn.Linear(16, 3)

    def forward(self, ids, offsets):
        return self.fc(self.emb(ids, offsets))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shard = ReviewShard(rank)
    if rank == 0:  # "only the main process prepares data"
        prepare_shard_cache(shard)
    loader = DataLoader(shard, batch_size=BATCH, shuffle=True, collate_fn=collate_reviews,
                        generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    model = DDP(FastTextClassifier())
    opt = torch.optim.Adagrad(model.parameters(), lr=0.2)
    for step, (ids, offsets, y) in enumerate(loader):
        loss = F.cross_entropy(model(ids, offsets), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 15 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
