"""Per-task metric meters synced in each rank's own first-seen order -> hang in epoch 1.

Story: a multi-task model for a music catalogue.  One shared encoder, two heads: `tag`
(genre classification, 6 genres) and `match` (an embedding matched against the track's
reference embedding, scored by recall@1 over a bank of embeddings).  Every sample carries its
task; batches are mixed.  The epoch's meters live in a plain dict that is filled lazily, in
the order the rank first meets each task in its own batches (`meters.setdefault(...)`), and
at the end of the epoch `sync_meters()` walks `meters.values()`: a TagMeter all-reduces its
confusion matrix, a MatchMeter all-gathers its embedding bank.  In epoch 0 both ranks happen
to open with a `tag` sample, so the orders agree and the sync works.  In epoch 1 the
DistributedSampler's reshuffle puts a `match` sample first on rank 1 only: rank 0 enters the
confusion all_reduce while rank 1 enters the bank all_gather.  The ops differ at the same
collective number, so both wait forever.

Root cause: no single rank; the ranks iterate a per-rank, insertion-ordered dict (set up at
the `setdefault` in `run_epoch`) and so issue their collectives in different orders.
Fix: sync the meters in a fixed order that is the same on every rank (`for task in
TASKS:` / `sorted(...)`), creating empty meters for tasks a rank has not seen.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = {
    "kind": ["collective_mismatch", "hang"],
    "rank": None,
    "fix": ["order", "sorted", "same order", "fixed", "every rank", "all ranks"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

TASKS = ("tag", "match")
N_TRACKS = 1536
N_GENRES = 6
EMB = 16
BANK = 64


class Catalogue(Dataset):
    def __init__(self, n=N_TRACKS):
        self.task = (torch.rand(n, generator=torch.Generator().manual_seed(11)) < 0.5).long()
        g = torch.Generator().manual_seed(12)
        self.genre = torch.randint(0, N_GENRES, (n,), generator=g)
        self.ref = F.normalize(torch.randn(n, EMB, generator=g), dim=-1)
        proto = torch.randn(N_GENRES, 48, generator=g)
        self.x = proto[self.genre] + 0.8 * torch.randn(n, 48, generator=g)
        self.x[:, :EMB] += 2 * self.ref

    def __len__(self):
        return len(self.task)

    def __getitem__(self, i):
        return {"x": self.x[i], "task": self.task[i], "genre": self.genre[i], "ref": self.ref[i]}


class MultiTaskNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU())
        self.tag = nn.Linear(96, N_GENRES)
        self.match = nn.Linear(96, EMB)

    def forward(self, x):
        h = self.encoder(x)
        return self.tag(h), F.normalize(self.match(h), dim=-1)


class TagMeter:
    def __init__(self):
        self.confusion = torch.zeros(N_GENRES, N_GENRES, dtype=torch.int64)

    def update(self, logits, genre):
        pred = logits.argmax(-1)
        self.confusion.index_put_((genre, pred), torch.ones_like(genre), accumulate=True)

    def sync(self):
        dist.all_reduce(self.confusion)
        return {"tag_acc": (self.confusion.diag().sum() / self.confusion.sum().clamp(min=1)).item()}


class MatchMeter:
    def __init__(self):
        self.emb = torch.zeros(BANK, EMB)
        self.ref = torch.zeros(BANK, EMB)
        self.filled = 0

    def update(self, emb, ref):
        take = min(BANK - self.filled, len(emb))
        self.emb[self.filled:self.filled + take] = emb[:take]
        self.ref[self.filled:self.filled + take] = ref[:take]
        self.filled += take

    def sync(self):
        world = dist.get_world_size()
        both = torch.cat([self.emb, self.ref], dim=1)
        bank = [torch.empty_like(both) for _ in range(world)]
        dist.all_gather(bank, both)
        bank = torch.cat(bank)
        emb, ref = bank[:, :EMB], bank[:, EMB:]
        hit = (emb @ ref.T).argmax(-1) == torch.arange(len(bank))
        return {"match_r@1": hit.float().mean().item()}


METER_FOR = {"tag": TagMeter, "match": MatchMeter}


def run_epoch(model, loader, opt):
    meters = {}
    for batch in loader:
        logits, emb = model(batch["x"])
        is_tag = batch["task"] == 0
        tag_loss = F.cross_entropy(logits[is_tag], batch["genre"][is_tag], reduction="sum")
        match_loss = (1 - (emb[~is_tag] * batch["ref"][~is_tag]).sum(-1)).sum()
        loss = (tag_loss + match_loss) / len(is_tag)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for t in batch["task"].tolist():
                meters.setdefault(TASKS[t], METER_FOR[TASKS[t]]())  # first seen, first synced
            if is_tag.any():
                meters["tag"].update(logits[is_tag], batch["genre"][is_tag])
            if (~is_tag).any():
                meters["match"].update(emb[~is_tag], batch["ref"][~is_tag])
    return meters


def sync_meters(meters):
    results = {}
    for meter in meters.values():  # zoo: place
        results.update(meter.sync())
    return results


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(3)
    data = Catalogue()
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=48, sampler=sampler)
    model = DDP(MultiTaskNet())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    for epoch in range(4):
        sampler.set_epoch(epoch)
        meters = run_epoch(model, loader, opt)
        results = sync_meters(meters)
        if rank == 0:
            print(f"epoch {epoch}: " + ", ".join(f"{k} {v:.3f}" for k, v in results.items()), flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
