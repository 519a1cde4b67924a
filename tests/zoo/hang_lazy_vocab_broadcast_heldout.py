"""A lazily built vocabulary broadcasts on first use, and only rank 0 uses it (hang).

Story: `Vocab.itos` is a `functools.cached_property`: on first access it builds the
id->token table on rank 0 and shares it with `dist.broadcast_object_list(..., src=0)`
"so that every rank decodes with exactly rank 0's table".  Training never needs it (the
model consumes ids).  The only reader is the sample logger, which runs on rank 0 every
10 steps: `if rank == 0 and step % 10 == 0: print(vocab.decode(ids))`.  At step 10 rank 0
enters the broadcast inside the property, alone; rank 1 has gone on to step 11 and waits
in DDP's gradient all-reduce.  The job hangs (or gloo errors on the mismatched messages).

Root cause: rank 0 (a collective hidden in a lazily evaluated property that only rank 0
reaches).
Right diagnosis: a collective (broadcast) only rank 0 issued, at Vocab.itos, called from
the rank-0 logging block, while rank 1 is in the gradient all-reduce.
Fix: touch `vocab.itos` on every rank before the loop (build it eagerly in __init__ on
all ranks), or let rank 0 decode with a local table, no collective.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": 0,
    "fix": ["every rank", "all ranks", "each rank", "outside", "before the loop", "eager",
            "unconditional", "not only", "out of the", "without a collective",
            "no collective"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

VOCAB_SIZE = 200


class Vocab:
    def __init__(self, rank):
        self.rank = rank

    def _build_from_files(self):
        return [f"tok{i}" for i in range(VOCAB_SIZE)]

    @functools.cached_property
    def itos(self):
        payload = [self._build_from_files()] if self.rank == 0 else [None]
        dist.broadcast_object_list(payload, src=0)  # zoo: place
        return payload[0]

    def decode(self, ids):
        return " ".join(self.itos[i] for i in ids)


class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB_SIZE, 48, mode="mean")
        self.head = nn.Sequential(nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 3))

    def forward(self, ids):
        return self.head(self.emb(ids))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    vocab = Vocab(rank)
    torch.manual_seed(0)
    model = DDP(BagClassifier())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB_SIZE, (1200, 12), generator=g)
    labels = ids[:, 0] % 3
    data = TensorDataset(ids, labels)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=20, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 10 == 0 and step > 0:
                sample = vocab.decode(x[0].tolist())  # zoo: place
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} | {sample[:40]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
