"""Multi-head recommender whose per-head statistics are gathered only for the heads that are
still below their target accuracy, judged by each rank's own validation shard.

The job: a recommender with user and item towers (ID embeddings plus side features) and a
shared MLP predicts four things about a user/item interaction: click (2 classes), share level
(3 classes), rating (5 classes) and a dwell-time bucket (8 classes). After every epoch each
rank evaluates its shard of the validation set and keeps, per head, one tensor of loss sum,
count and hits per class, so the heads' tensors have different sizes: 4, 5, 7 and 10 numbers.
The report then all-gathers each head's tensor from all ranks (to show the per-rank split,
which is how the team spots skewed shards). To keep the report short, a head that has reached
its launch-bar accuracy drops out of it: only the heads still below target are gathered.

The bug: the "below target" filter looks at each rank's local accuracy, before anything is
combined. For the first four epochs every head is below target on both ranks and both gather
the same four heads; after epoch 4 the rating head is at 0.627 on rank 0 (over the 0.62 bar)
and at 0.613 on rank 1, so rank 0 leaves it out. At the third position rank 0 all-gathers the
10-number dwell tensor while rank 1 all-gathers the 7-number rating tensor: the sizes differ.
Rank 1 aborts inside that gather; rank 0 takes rank 1's shorter rating tensor into its dwell
slot without noticing, prints a wrong "dwell" loss for rank 1, and dies in the next backward
because rank 1 is gone.

Fix: decide which heads to report from all-reduced counts (the same numbers on every rank), or
gather every head every epoch and filter only what is printed.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": None, "rank": None, "fix": [], "options": ["--hang-timeout", "8", "--on-hang", "kill"]}

HEADS = {"click": 2, "share": 3, "rating": 5, "dwell": 8}
N_USERS, N_ITEMS, DIM, N_FEAT = 200, 300, 8, 8
EPOCHS = 12
# the launch bar per head; a head that has reached it drops out of the detailed report
TARGET_ACC = {"click": 0.90, "share": 0.80, "rating": 0.62, "dwell": 0.60}


def make_interactions(n=3072, seed=0):
    g = torch.Generator().manual_seed(seed)
    user_feat = torch.randn(N_USERS, N_FEAT, generator=g)
    item_feat = torch.randn(N_ITEMS, N_FEAT, generator=g)
    mix = torch.randn(N_FEAT, N_FEAT, generator=g) / N_FEAT ** 0.5
    users = torch.randint(0, N_USERS, (n,), generator=g)
    items = torch.randint(0, N_ITEMS, (n,), generator=g)
    affinity = ((user_feat[users] @ mix) * item_feat[items]).sum(1)
    noisy = lambda s: affinity + s * torch.randn(n, generator=g)  # noqa: E731
    click = (noisy(0.5) > 0).long()
    share = torch.bucketize(noisy(0.8), torch.tensor([0.5, 1.2]))
    rating = torch.bucketize(noisy(0.4), torch.tensor([-1.0, -0.3, 0.3, 1.0]))
    dwell = torch.bucketize(noisy(0.9), torch.linspace(-1.5, 1.5, 7))
    return user_feat, item_feat, TensorDataset(users, items, click, share, rating, dwell)


class Recommender(nn.Module):
    def __init__(self, user_feat, item_feat):
        super().__init__()
        self.register_buffer("user_feat", user_feat)
        self.register_buffer("item_feat", item_feat)
        self.users = nn.Embedding(N_USERS, DIM)
        self.items = nn.Embedding(N_ITEMS, DIM)
        self.user_tower = nn.Sequential(nn.Linear(DIM + N_FEAT, 32), nn.ReLU())
        self.item_tower = nn.Sequential(nn.Linear(DIM + N_FEAT, 32), nn.ReLU())
        self.mlp = nn.Sequential(nn.Linear(3 * 32, 64), nn.ReLU())
        self.heads = nn.ModuleDict({name: nn.Linear(64, k) for name, k in HEADS.items()})

    def forward(self, users, items):
        u = self.user_tower(torch.cat([self.users(users), self.user_feat[users]], 1))
        i = self.item_tower(torch.cat([self.items(items), self.item_feat[items]], 1))
        h = self.mlp(torch.cat([u, i, u * i], 1))
        return {name: head(h) for name, head in self.heads.items()}


class HeadTracker:
    def __init__(self):
        self.stats = {}

    def start_epoch(self):
        self.stats = {name: torch.zeros(2 + k) for name, k in HEADS.items()}

    def update(self, name, logits, target):
        s = self.stats[name]
        s[0] += F.cross_entropy(logits, target, reduction="sum")
        s[1] += target.numel()
        hit = (logits.argmax(1) == target).float()
        s[2:] += torch.zeros(HEADS[name]).index_add_(0, target, hit)

    def accuracy(self, name):
        return (self.stats[name][2:].sum() / self.stats[name][1]).item()


def gather_heads(tracker, names):
    world = dist.get_world_size()
    gathered = {}
    for name in names:
        parts = [torch.zeros_like(tracker.stats[name]) for _ in range(world)]
        dist.all_gather(parts, tracker.stats[name])
        gathered[name] = parts
    return gathered


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    user_feat, item_feat, data = make_interactions()
    train = TensorDataset(*data[:2048])
    val = TensorDataset(*data[2048:])
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=64, sampler=sampler)
    val_loader = DataLoader(val, batch_size=128, sampler=DistributedSampler(val, shuffle=False))
    model = DDP(Recommender(user_feat, item_feat))
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    tracker = HeadTracker()

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        for users, items, *targets in loader:
            out = model(users, items)
            loss = sum(F.cross_entropy(out[name], t) for name, t in zip(HEADS, targets))
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        tracker.start_epoch()
        with torch.no_grad():
            for users, items, *targets in val_loader:
                out = model(users, items)
                for name, t in zip(HEADS, targets):
                    tracker.update(name, out[name], t)
        pending = [name for name in HEADS if tracker.accuracy(name) < TARGET_ACC[name]]  # zoo: place
        gathered = gather_heads(tracker, pending)
        if rank == 0:
            text = "  ".join(
                f"{name} " + "/".join(f"{(p[0] / p[1]).item():.3f}" for p in parts)
                for name, parts in gathered.items())
            print(f"epoch {epoch} heads below target, val loss per rank: {text}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
