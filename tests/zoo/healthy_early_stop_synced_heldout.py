"""HEALTHY twin of the per-rank early-stopping hang: the stop decision is shared.

Story: same bag-of-words classifier and EarlyStopper as in the buggy version, and rank 1
still has the noisy validation shard.  But here every rank all-reduces its validation
loss (sum of losses and counts), so the stopper sees the *global* validation loss, and
the stop flag is additionally all-reduced (MAX) before breaking out -- both ranks leave
the epoch loop at the same epoch.  Per-class accuracy is gathered with an all_gather of
equal-shaped tensors on every rank; only rank 0 prints it.  Rank-dependent validation
data, but identical collective sequences.  Exits 0.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None


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
    logits = model(x)
    loss_sum = F.cross_entropy(logits, y, reduction="sum")
    per_class = torch.stack(
        [((logits.argmax(-1) == y) & (y == c)).sum() / (y == c).sum().clamp(min=1) for c in range(4)]
    ).float()
    model.train()
    stats = torch.stack([loss_sum, torch.tensor(float(len(y)))])
    dist.all_reduce(stats)
    gathered = [torch.zeros(4) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, per_class)
    return (stats[0] / stats[1]).item(), torch.stack(gathered)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(BagOfWords())
    opt = torch.optim.SGD(model.parameters(), lr=0.3)

    train_x, train_y = make_split(100 + rank, 256, noisy=False)
    val_x, val_y = make_split(200 + rank, 128, noisy=(rank == 1))
    stopper = EarlyStopper(patience=2, min_delta=4e-3)

    for epoch in range(15):
        for i in range(0, 256, 32):
            loss = F.cross_entropy(model(train_x[i : i + 32]), train_y[i : i + 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
        val, per_class = evaluate(model.module, val_x, val_y)
        stop = torch.tensor(float(stopper.should_stop(val)))
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"epoch {epoch} val {val:.4f} per-rank acc {per_class.mean(1).tolist()}", flush=True)
        if stop.item() > 0:
            if rank == 0:
                print(f"early stopping at epoch {epoch}", flush=True)
            break

    dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), os.devnull)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
