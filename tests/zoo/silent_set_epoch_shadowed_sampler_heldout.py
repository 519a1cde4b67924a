"""`sampler` is rebound to the validation sampler, so set_epoch never reaches the training
sampler (silent: every epoch replays the same order).

Story: a sentiment classifier over bag-of-words review vectors.  `build_loaders` first creates
the training DistributedSampler and DataLoader, then -- copy-pasted a few lines further down
-- the validation ones, reusing the variable name `sampler`.  It returns that `sampler` so the
loop can call `sampler.set_epoch(epoch)`.  The call dutifully runs every epoch, but on the
*validation* sampler (shuffle=False, where the epoch does not matter); the training sampler
stays at epoch 0, so each rank sees exactly the same sample order (and the same shard split)
in all 5 epochs.  Nothing fails; the job exits 0 and the model is a little worse.

Root cause: the training DistributedSampler's epoch never changes (no set_epoch on it); the
name `sampler` was shadowed by the validation sampler in build_loaders.
Right diagnosis: missing set_epoch on the training sampler (every rank) -- the same
permutation is replayed each epoch although a set_epoch call exists (on the wrong sampler).
Fix: call `set_epoch(epoch)` on the training loader's sampler (`train_loader.sampler`, or keep
separate names `train_sampler` / `val_sampler`).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": ["set_epoch"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

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
    sampler = DistributedSampler(train_ds, world, rank, shuffle=True, seed=17)  # zoo: place
    train_loader = DataLoader(train_ds, batch_size=40, sampler=sampler)
    sampler = DistributedSampler(val_ds, world, rank, shuffle=False)
    val_loader = DataLoader(val_ds, batch_size=100, sampler=sampler)
    return train_loader, val_loader, sampler


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_loader, val_loader, sampler = build_loaders(rank, world)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(VOCAB, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    for epoch in range(5):
        sampler.set_epoch(epoch)  # zoo: place
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
