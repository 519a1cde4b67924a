"""A metrics helper returns early on one rank and skips its all_reduce -> hang at the barrier.

Story: a fraud classifier (tabular MLP).  After every epoch each rank scores a quick random
sample of its own node's validation shard and reports the recall on the rare "fraud" class
through `global_rare_recall`, which sums hits and counts over the ranks with an all_reduce.
The helper has a shortcut: when the sample holds no fraud case it returns None at once,
"nothing to add".  Rank 1's validation shard is from a region with very little fraud, so in a
later epoch its 48-sample draw holds none: rank 1 returns early and goes on to the
`dist.barrier()` before rank 0's checkpoint, while rank 0 sits in the helper's all_reduce.
The two never meet: both wait forever.

Root cause: rank 1 (skipped the helper's all_reduce through its early return).
Fix: every rank must call the all_reduce every time -- contribute zeros instead of returning
early, and decide "no fraud anywhere" from the reduced count.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": ["hang", "rank_only_collective", "collective_mismatch"],
    "rank": 1,
    "fix": ["every rank", "all ranks", "early return", "return", "skip", "zeros", "global_rare_recall"],
    "never": ["skipped the barrier"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

FRAUD = 1
FEATURES = 24


def make_transactions(seed, n, fraud_rate):
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) < fraud_rate).long()
    x = torch.randn(n, FEATURES, generator=g)
    x[:, :4] += 1.5 * y[:, None].float()
    return x, y


def global_rare_recall(pred, y, rare=FRAUD):
    """Recall on the rare class, over every rank's validation sample."""
    mask = y == rare
    if mask.sum() == 0:
        return None  # zoo: place
    stats = torch.stack([(pred[mask] == rare).sum(), mask.sum()]).float()
    dist.all_reduce(stats)  # zoo: place
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def quick_validation(net, val_x, val_y, gen, k=48):
    idx = torch.randperm(len(val_y), generator=gen)[:k]
    pred = net(val_x[idx]).argmax(-1)
    acc = (pred == val_y[idx]).float().mean().item()
    return acc, global_rare_recall(pred, val_y[idx])


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    train_x, train_y = make_transactions(7, 2048, fraud_rate=0.1)
    train = TensorDataset(train_x, train_y)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=64, sampler=sampler)
    # each node keeps the validation shard of its own region
    val_x, val_y = make_transactions(100 + rank, 400, fraud_rate=0.12 if rank == 0 else 0.02)
    val_gen = torch.Generator().manual_seed(3 + rank)

    model = DDP(nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = os.path.join(tempfile.gettempdir(), f"fraud-mlp-{os.getpid()}.pt")

    for epoch in range(8):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        acc, recall = quick_validation(model.module, val_x, val_y, val_gen)
        model.train()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} val acc {acc:.3f} fraud recall {recall}", flush=True)
        dist.barrier()
        if rank == 0:
            torch.save(model.module.state_dict(), ckpt)
    if rank == 0:
        os.remove(ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
