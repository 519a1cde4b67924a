"""Healthy twin: the rare-class recall helper always all-reduces, empty samples contribute zeros.

Story: the fraud classifier of the rare-recall case.  After every epoch each rank scores a
quick random sample of its own region's validation shard and `global_rare_recall` sums
(hits, fraud count) over the ranks.  Rank 1's region has very little fraud and in some epochs
its sample holds none -- but the helper still takes part in the all_reduce with zeros, and
"no fraud anywhere" is decided from the reduced count, the same on every rank.  Then the
barrier and rank 0's checkpoint.

Nothing is wrong: no warning and no error expected.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

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
    stats = torch.stack([(pred[mask] == rare).sum(), mask.sum()]).float()  # zeros if none here
    dist.all_reduce(stats)
    if stats[1] == 0:
        return None  # no fraud in any rank's sample
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
    dist.barrier()  # everyone done before tearing the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
