"""Healthy twin of silent_set_epoch_shadowed_sampler: separate names, set_epoch on the
training sampler.

Story: the bag-of-words sentiment classifier.  `build_loaders` keeps `train_sampler` and
`val_sampler` apart and returns the training one; the loop calls
`train_sampler.set_epoch(epoch)` every epoch, so each epoch uses a new permutation (and a new
split of the data between the ranks).  The validation loader is deterministic
(shuffle=False) and needs no set_epoch.  The job trains 5 epochs and exits 0.

Right diagnosis: nothing wrong (set_epoch is called on the sampler that shuffles).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = None

VOCAB = 300


def reviews(n, seed):
    g = torch.Generator().manual_seed(seed)
    sentiment = torch.randint(0, 2, (n,), generator=g)
    polar = torch.zeros(2, VOCAB)
    polar[0, :20], polar[1, 20:40] = 1.0, 1.0
    counts = torch.poisson(0.05 * torch.ones(n, VOCAB) + 0.3 * polar[sentiment], generator=g)
    return TensorDataset(torch.log1p(counts), sentiment)


def build_loaders(rank, world):
    train_ds, val_ds = reviews(2400, 0), reviews(400, 1)
    train_sampler = DistributedSampler(train_ds, world, rank, shuffle=True, seed=17)
    train_loader = DataLoader(train_ds, batch_size=40, sampler=train_sampler)
    val_sampler = DistributedSampler(val_ds, world, rank, shuffle=False)
    val_loader = DataLoader(val_ds, batch_size=100, sampler=val_sampler)
    return train_loader, val_loader, train_sampler


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_loader, val_loader, train_sampler = build_loaders(rank, world)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(VOCAB, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    for epoch in range(5):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.module.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for x, y in val_loader:
                correct += torch.tensor([(model.module(x).argmax(1) == y).sum().item(), len(y)])
        dist.all_reduce(correct)
        if rank == 0:
            print(f"epoch {epoch} train loss {loss.item():.3f} "
                  f"val acc {correct[0] / correct[1]:.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
