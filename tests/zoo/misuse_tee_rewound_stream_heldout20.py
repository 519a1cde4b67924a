"""A stream made once and re-wound with itertools.tee: set_epoch never gets a new pass.

Story: a matrix-factorisation recommender (user/item embeddings plus biases) trained for a
step budget by a small in-house trainer.  The trainer wants to write `for batch in feed` once
per epoch, and its data module hands it a `Rewindable` wrapper around the loader: the wrapper
opens the loader's iterator once in its constructor and, on every `__iter__`, splits the stream
with `itertools.tee`, handing one copy out and keeping the other as the "spare" for next time.
The first epoch consumes the loader's only pass (sampler epoch 0) and tee buffers every batch
for the spare; every later epoch iterates a tee of that buffer, i.e. the epoch-0 batches in the
epoch-0 order.  The trainer dutifully calls `sampler.set_epoch(epoch)` at each epoch, but the
DataLoader is never iterated again, so the new order is never drawn, on any rank.

Root cause: no single rank; each rank replays its first pass.
Fix: let `__iter__` start a new pass of the loader (`return iter(self.loader)`) after
`set_epoch`, instead of re-winding one stream with tee.
"""

import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = {
    "kind": ["missing_set_epoch"],
    "rank": None,
    "fix": ["new pass", "iterate", "each epoch", "every epoch", "set_epoch", "cycle", "tee",
            "iter("],
    "options": [],
}

N_USERS, N_ITEMS = 300, 200


class Ratings(Dataset):
    """Synthetic explicit ratings from hidden low-rank tastes."""

    def __init__(self, n=1536, rank=6, seed=21):
        g = torch.Generator().manual_seed(seed)
        u_true = torch.randn(N_USERS, rank, generator=g)
        i_true = torch.randn(N_ITEMS, rank, generator=g)
        self.users = torch.randint(0, N_USERS, (n,), generator=g)
        self.items = torch.randint(0, N_ITEMS, (n,), generator=g)
        score = (u_true[self.users] * i_true[self.items]).sum(1) / rank ** 0.5
        self.ratings = (3.0 + score + 0.2 * torch.randn(n, generator=g)).clamp(1.0, 5.0)

    def __len__(self):
        return len(self.ratings)

    def __getitem__(self, i):
        return self.users[i], self.items[i], self.ratings[i]


class MF(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.user = nn.Embedding(N_USERS, dim)
        self.item = nn.Embedding(N_ITEMS, dim)
        self.user_bias = nn.Embedding(N_USERS, 1)
        self.item_bias = nn.Embedding(N_ITEMS, 1)
        self.mu = nn.Parameter(torch.tensor(3.0))
        for emb in (self.user, self.item):
            nn.init.normal_(emb.weight, std=0.1)
        for emb in (self.user_bias, self.item_bias):
            nn.init.zeros_(emb.weight)

    def forward(self, u, i):
        dot = (self.user(u) * self.item(i)).sum(1)
        return self.mu + dot + self.user_bias(u).squeeze(1) + self.item_bias(i).squeeze(1)


class Rewindable:
    """Makes a one-shot batch stream iterable any number of times (one epoch per `for`)."""

    def __init__(self, loader):
        self.loader = loader
        self._spare = iter(loader)

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        current, self._spare = itertools.tee(self._spare)  # zoo: place
        return current


class RatingsModule:
    def __init__(self, batch_size=48):
        self.dataset = Ratings()
        self.sampler = DistributedSampler(self.dataset, shuffle=True, seed=9)
        loader = DataLoader(self.dataset, batch_size=batch_size, sampler=self.sampler,
                            drop_last=True)
        self.feed = Rewindable(loader)


class Trainer:
    def __init__(self, model, data, max_steps, log_every=25):
        self.model, self.data = model, data
        self.max_steps, self.log_every = max_steps, log_every
        self.opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def train_step(self, batch):
        u, i, r = batch
        loss = F.mse_loss(self.model(u, i), r)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def fit(self):
        step, epoch = 0, 0
        while step < self.max_steps:
            self.data.sampler.set_epoch(epoch)
            for batch in self.data.feed:
                loss = self.train_step(batch)
                if dist.get_rank() == 0 and step % self.log_every == 0:
                    print(f"step {step} (epoch {epoch}): mse {loss:.4f}", flush=True)
                step += 1
                if step >= self.max_steps:
                    break
            epoch += 1


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = RatingsModule()
    model = DDP(MF())
    Trainer(model, data, max_steps=5 * len(data.feed)).fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
