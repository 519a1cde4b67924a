"""A step-based trainer feeds DDP from itertools.cycle(loader): set_epoch never takes effect.

Story: a character-level next-token model for short product titles, trained for a fixed
number of optimizer steps (the team's convention), not epochs.  The loader is correct on its
face: a DistributedSampler with shuffle=True, and the trainer calls `sampler.set_epoch()`
whenever the step counter crosses an epoch boundary.  But the batches come from
`itertools.cycle(loader)`: cycle iterates the DataLoader once, keeps every batch it yielded,
and from then on replays those saved batches in the same order.  The sampler's epoch changes,
but it is never iterated again, so every "epoch" after the first is a replay of epoch 0 on
every rank: the same batches in the same order, five times over.

Root cause: no single rank; every rank replays its first pass (the set_epoch calls reach a
sampler that `itertools.cycle` never asks for a new order).
Fix: drop itertools.cycle; start a new pass of the loader for each epoch (`for batch in
loader` inside the epoch loop, or an infinite generator that calls `set_epoch` and
`iter(loader)` at each boundary).
"""

import itertools
import string

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
    "fix": ["cycle", "iter(", "new pass", "each epoch", "every epoch", "re-create", "recreate",
            "set_epoch"],
    "options": [],
}

ALPHABET = string.ascii_lowercase + " -"
SEQ = 24
ADJ = ["soft", "large", "red", "steel", "compact", "vintage", "wireless", "organic", "smart"]
NOUN = ["lamp", "kettle", "chair", "blanket", "speaker", "mug", "backpack", "drill", "tent"]


class Titles(Dataset):
    def __init__(self, n=2048):
        g = torch.Generator().manual_seed(5)
        self.rows = []
        for _ in range(n):
            a, b, c = torch.randint(0, len(ADJ), (2,), generator=g).tolist() + \
                torch.randint(0, len(NOUN), (1,), generator=g).tolist()
            title = f"{ADJ[a]} {ADJ[b]} {NOUN[c]}"[:SEQ + 1].ljust(SEQ + 1)
            self.rows.append(torch.tensor([ALPHABET.index(ch) for ch in title]))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        return row[:-1], row[1:]


class CharLM(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.embed = nn.Embedding(len(ALPHABET), dim)
        self.rnn = nn.LSTM(dim, dim, batch_first=True)
        self.out = nn.Linear(dim, len(ALPHABET))

    def forward(self, x):
        h, _ = self.rnn(self.embed(x))
        return self.out(h)


class StepTrainer:
    def __init__(self, model, loader, sampler, total_steps, log_every=20):
        self.model, self.loader, self.sampler = model, loader, sampler
        self.total_steps, self.log_every = total_steps, log_every
        self.opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        self.steps_per_epoch = len(loader)

    def fit(self):
        batches = itertools.cycle(self.loader)  # zoo: place
        for step in range(self.total_steps):
            if step % self.steps_per_epoch == 0:
                self.sampler.set_epoch(step // self.steps_per_epoch)
            x, y = next(batches)
            logits = self.model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            if dist.get_rank() == 0 and step % self.log_every == 0:
                print(f"step {step}: loss {loss.item():.3f}", flush=True)


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = Titles()
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=64, sampler=sampler, drop_last=True)
    model = DDP(CharLM())
    StepTrainer(model, loader, sampler, total_steps=5 * len(loader)).fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
