"""Per-rank early stopping makes one rank leave the training loop early -> hang.

Story: a small text-classifier trainer uses an `EarlyStopper` helper (patience on the
validation loss).  Each rank evaluates on its *own* validation shard and asks the stopper
whether to stop -- the decision is never shared.  Rank 1's validation shard is noisy
(mislabelled crawl data), so its validation loss stops improving after a few epochs and
rank 1 breaks out of the epoch loop and waits in the final `dist.barrier()` before the
checkpoint.  Rank 0's validation loss keeps improving, so rank 0 starts another epoch and
blocks in DDP's gradient all-reduce in backward.  Both ranks wait forever.

Root cause: rank 1 (it left the loop / skipped the training collectives).
Right diagnosis: a hang; rank 1 is in the barrier after the loop while rank 0 is in the
backward all-reduce of a later step -- ranks took different early-stopping decisions.
Fix: make the stop decision collectively (all_reduce the stop flag, or broadcast rank 0's
decision) so every rank leaves the loop at the same epoch.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": [
        "all_reduce",
        "allreduce",
        "all-reduce",
        "broadcast",
        "every rank",
        "all ranks",
        "same decision",
        "agree",
        "collective",
        "synchron",
    ],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


class EarlyStopper:
    def __init__(self, patience=2, min_delta=1e-3):
        self.patience = patience
        self.min_delta = min_delta
        self.best = float("inf")
        self.bad_epochs = 0

    def should_stop(self, val_loss):
        if val_loss < self.best - self.min_delta:
            self.best = val_loss
            self.bad_epochs = 0
        else:
            self.bad_epochs += 1
        return self.bad_epochs >= self.patience


class BagOfWords(nn.Module):
    def __init__(self, vocab=200, dim=32, classes=4):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x):
        return self.fc(torch.relu(self.emb(x)))


def make_split(seed, n, noisy):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randint(0, 200, (n, 12), generator=g)
    x[:, :5] = y[:, None] * 50 + torch.randint(0, 50, (n, 5), generator=g)
    if noisy:
        y = torch.randint(0, 4, (n,), generator=g)
    return x, y


@torch.no_grad()
def evaluate(model, x, y):
    model.eval()
    loss = F.cross_entropy(model(x), y).item()
    model.train()
    return loss


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(BagOfWords())
    opt = torch.optim.SGD(model.parameters(), lr=0.3)

    train_x, train_y = make_split(100 + rank, 256, noisy=False)
    # validation shards come from different sources; rank 1 got the noisy crawl shard
    val_x, val_y = make_split(200 + rank, 128, noisy=(rank == 1))
    stopper = EarlyStopper(patience=2)

    for epoch in range(40):
        for i in range(0, 256, 32):
            loss = F.cross_entropy(model(train_x[i : i + 32]), train_y[i : i + 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
        val = evaluate(model.module, val_x, val_y)
        print(f"rank {rank} epoch {epoch} val {val:.4f}", flush=True)
        if stopper.should_stop(val):
            print(f"rank {rank} early stopping at epoch {epoch}", flush=True)
            break

    dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), os.devnull)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
