"""Healthy twin: per-task meters filled lazily per rank, but synced in one fixed order.

Story: a recipe model with two tasks on a shared encoder: `cuisine` (12-way classification,
scored by a confusion matrix) and `pairing` (an embedding of the recipe matched against its
drink pairing, scored by recall@1 over a gathered bank).  Each rank fills its `meters` dict
lazily, in the order its own batches present the tasks, and the order differs by rank and by
epoch; some epochs a rank may even see no `pairing` sample in a batch.  That looks like the
classic "collectives in dict order" trap, but `sync_all()` walks the module-level `TASKS`
tuple, the same on every rank, and makes an empty meter for a task the rank has not met,
so every rank issues all_reduce(confusion) then all_gather(bank) in that order every epoch.
Rank 0 alone prints the synced figures.

Root cause: none (healthy).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = None

TASKS = ("cuisine", "pairing")
CUISINES = 12
EMB = 16
BANK = 48


class Recipes(Dataset):
    def __init__(self, n=1536):
        g = torch.Generator().manual_seed(31)
        self.task = (torch.rand(n, generator=g) < 0.4).long()
        self.cuisine = torch.randint(0, CUISINES, (n,), generator=g)
        self.drink = F.normalize(torch.randn(n, EMB, generator=g), dim=-1)
        proto = torch.randn(CUISINES, 64, generator=g)
        self.x = proto[self.cuisine] + 0.7 * torch.randn(n, 64, generator=g)
        self.x[:, :EMB] += 2.5 * self.drink

    def __len__(self):
        return len(self.task)

    def __getitem__(self, i):
        return self.x[i], self.task[i], self.cuisine[i], self.drink[i]


class RecipeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96), nn.ReLU())
        self.cuisine = nn.Linear(96, CUISINES)
        self.pairing = nn.Linear(96, EMB)

    def forward(self, x):
        h = self.shared(x)
        return self.cuisine(h), F.normalize(self.pairing(h), dim=-1)


class ConfusionMeter:
    def __init__(self):
        self.counts = torch.zeros(CUISINES, CUISINES, dtype=torch.int64)

    def update(self, logits, target):
        self.counts.index_put_((target, logits.argmax(-1)), torch.ones_like(target), accumulate=True)

    def sync(self):
        dist.all_reduce(self.counts)
        return {"cuisine_acc": (self.counts.diag().sum() / self.counts.sum().clamp(min=1)).item()}


class PairingMeter:
    def __init__(self):
        self.bank = torch.zeros(BANK, 2 * EMB)
        self.n = 0

    def update(self, emb, drink):
        k = min(BANK - self.n, len(emb))
        self.bank[self.n:self.n + k] = torch.cat([emb[:k], drink[:k]], 1)
        self.n += k

    def sync(self):
        parts = [torch.zeros_like(self.bank) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, self.bank)
        bank = torch.cat(parts)
        filled = bank.abs().sum(1) > 0
        emb, drink = bank[filled, :EMB], bank[filled, EMB:]
        hits = (emb @ drink.T).argmax(-1) == torch.arange(len(emb))
        return {"pairing_r@1": hits.float().mean().item() if len(emb) else 0.0}


NEW_METER = {"cuisine": ConfusionMeter, "pairing": PairingMeter}


def sync_all(meters):
    out = {}
    for task in TASKS:  # one order on every rank; empty meters for tasks not met
        out.update(meters.get(task, NEW_METER[task]()).sync())
    return out


def train_epoch(model, loader, opt):
    meters = {}
    for x, task, cuisine, drink in loader:
        logits, emb = model(x)
        is_c = task == 0
        loss_c = F.cross_entropy(logits[is_c], cuisine[is_c], reduction="sum")
        loss_p = (1 - (emb[~is_c] * drink[~is_c]).sum(-1)).sum()
        loss = (loss_c + loss_p) / len(task)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for t in task.unique(sorted=False).tolist():
                meters.setdefault(TASKS[t], NEW_METER[TASKS[t]]())
            if is_c.any():
                meters["cuisine"].update(logits[is_c], cuisine[is_c])
            if (~is_c).any():
                meters["pairing"].update(emb[~is_c], drink[~is_c])
    return meters


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = Recipes()
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=48, sampler=sampler)
    model = DDP(RecipeNet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for epoch in range(5):
        sampler.set_epoch(epoch)
        results = sync_all(train_epoch(model, loader, opt))
        if rank == 0:
            print(f"epoch {epoch}: " + "  ".join(f"{k} {v:.3f}" for k, v in results.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
