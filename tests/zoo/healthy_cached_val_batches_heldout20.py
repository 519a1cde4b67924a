"""Healthy twin: only the small, fixed validation set is kept as a list of batches.

Story: a support-ticket router (hashed bag-of-words into an EmbeddingBag, then a linear
classifier) that evaluates after every epoch.  Tokenising the validation tickets is as slow
as the training ones, and the validation set is small and never reshuffled, so the script
keeps it as `val_batches = list(val_loader)`, built once before training, each rank holding
its own shard (a DistributedSampler with shuffle=False).  That is the same `list(loader)` as
the replaying jobs, but on data whose order is meant to stay the same.  The training loader
is iterated anew in each epoch, after `train_sampler.set_epoch(epoch)`, so training sees a
new order every epoch.  Nothing is wrong here.
"""

import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = None

QUEUES = {
    "billing": ["invoice", "refund", "charged", "twice", "card", "payment", "receipt"],
    "login": ["password", "reset", "locked", "account", "2fa", "code", "email"],
    "shipping": ["parcel", "tracking", "delayed", "courier", "address", "delivery"],
    "bug": ["crash", "error", "button", "page", "blank", "freezes", "update"],
}
FILLER = ["hi", "please", "help", "my", "the", "is", "not", "since", "yesterday", "thanks",
          "urgent", "again", "still", "cannot", "why"]
BUCKETS, TOKENS = 4096, 16


def hash_tokens(words):
    ids = [zlib.crc32(w.encode()) % BUCKETS for w in words]
    ids += [zlib.crc32(f"{a}_{b}".encode()) % BUCKETS for a, b in zip(words, words[1:])]
    ids = (ids + [0] * TOKENS)[:TOKENS]
    return torch.tensor(ids)


class Tickets(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        names = list(QUEUES)
        self.rows = []
        for _ in range(n):
            q = int(torch.randint(0, len(names), (1,), generator=g))
            vocab = QUEUES[names[q]]
            words = []
            for _ in range(8):
                if torch.rand(1, generator=g).item() < 0.4:
                    words.append(vocab[int(torch.randint(0, len(vocab), (1,), generator=g))])
                else:
                    words.append(FILLER[int(torch.randint(0, len(FILLER), (1,), generator=g))])
            self.rows.append((words, q))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        words, q = self.rows[i]
        return hash_tokens(words), q


class Router(nn.Module):
    def __init__(self, dim=48):
        super().__init__()
        self.bag = nn.EmbeddingBag(BUCKETS, dim, mode="mean")
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, len(QUEUES))

    def forward(self, ids):
        return self.out(F.relu(self.hidden(self.bag(ids))))


@torch.no_grad()
def evaluate(model, val_batches):
    model.eval()
    stats = torch.zeros(3)
    for ids, q in val_batches:
        logits = model(ids)
        stats += torch.tensor([F.cross_entropy(logits, q, reduction="sum").item(),
                               (logits.argmax(1) == q).sum().item(), len(q)])
    dist.all_reduce(stats)
    model.train()
    return stats[0] / stats[2], stats[1] / stats[2]


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    train_set, val_set = Tickets(1024, seed=1), Tickets(192, seed=2)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=5)
    train_loader = DataLoader(train_set, batch_size=32, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=48,
                            sampler=DistributedSampler(val_set, shuffle=False))
    val_batches = list(val_loader)  # tokenised once; validation order never changes

    model = DDP(Router())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(5):
        train_sampler.set_epoch(epoch)
        for ids, q in train_loader:
            loss = F.cross_entropy(model(ids), q)
            opt.zero_grad()
            loss.backward()
            opt.step()
        val_loss, val_acc = evaluate(model, val_batches)
        if rank == 0:
            print(f"epoch {epoch}: train {loss.item():.3f} val {val_loss:.3f} "
                  f"acc {val_acc:.2%}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
