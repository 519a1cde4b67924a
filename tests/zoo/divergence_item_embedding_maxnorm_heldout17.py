"""Session recommender whose item embedding has max_norm set: nn.Embedding renormalises, in
place and under no_grad, the rows each forward looks up -- and each rank looks up different
rows.

Story: next-category prediction for shopping sessions.  Each session is 20 item ids; the model
embeds the items (nn.Embedding(6000, 32, max_norm=1.0)), mean-pools them, and a small MLP
predicts the category (40 classes) of the next item.  max_norm=1.0 was copied from a
single-GPU notebook where it "keeps popular items from blowing up".  Under DDP every rank's
forward calls torch.embedding_renorm_ on the rows in *its own* batch, before autograd sees
them: a rank-dependent in-place change to a parameter after wrapping.  The all-reduced
gradients are identical on both ranks, but the weights they are applied to are not, so the
replicas of `items.weight` drift apart from the first step on and never come back together.
No error, no warning from PyTorch: the loss goes down on both ranks.

Root cause: the max_norm renormalisation in the embedding (no single rank at fault: each rank
rescales the rows of its own batch).
Right diagnosis: weights_diverged (items.weight differs between ranks from step 0/1 on), a
rank-dependent update after wrapping.
Fix: drop max_norm (use weight decay / an explicit renorm of the whole table applied the same
way on every rank), or broadcast the parameters again.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": "weights_diverged",
    "rank": None,
    "fix": ["max_norm", "renorm", "broadcast", "every rank", "all ranks", "same on every",
            "rank-dependent", "after wrapping"],
    "names": ["items.weight"],
    "options": [],
}

N_ITEMS = 6000
N_CATS = 40
SESSION_LEN = 20
BATCH = 32
EPOCHS = 10


def make_sessions(n, seed):
    g = torch.Generator().manual_seed(seed)
    # popular items are drawn far more often (Zipf-like), categories follow item id blocks
    probs = 1.0 / torch.arange(1, N_ITEMS + 1, dtype=torch.float) ** 0.8
    items = torch.multinomial(probs.expand(n, -1), SESSION_LEN, replacement=True, generator=g)
    nxt = torch.multinomial(probs, n, replacement=True, generator=g)
    return TensorDataset(items, nxt % N_CATS)


class SessionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(N_ITEMS, 32, max_norm=1.0)  # zoo: place
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, N_CATS))

    def forward(self, sessions):
        return self.mlp(self.items(sessions).mean(dim=1))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = make_sessions(4800, seed=7)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = DDP(SessionModel())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for sessions, cats in loader:
            loss = F.cross_entropy(model(sessions), cats)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            step += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
