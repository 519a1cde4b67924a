"""Aqueous-solubility (logS) regression from 512-bit molecular fingerprints (2-rank DDP, gloo/CPU).

What the job does
-----------------
1600 synthetic molecules are represented by sparse binary Morgan-style fingerprints
(20-60 on-bits each); logS is a sparse linear function of substructure bits plus a
non-linear size term and noise.  The script uses the textbook recipe: a Dataset,
`DistributedSampler(shuffle=True)`, a DataLoader, an MLP wrapped in DDP and Adam, for 12
epochs.  Each epoch logs the loss, the first molecule ids of the epoch and a digest of
the order in which this rank visited its molecules.

Root cause
----------
The epoch loop never calls `sampler.set_epoch(epoch)`.  DistributedSampler seeds its
permutation with `seed + epoch`, and `epoch` stays 0, so every epoch replays exactly the
same permutation and the same per-rank split: each rank sees the same molecules in the
same order, epoch after epoch ("shuffle=True" is effectively a fixed shuffle).  Nothing
crashes; the training is just less well mixed than the author believes.

Fix
---
Call `sampler.set_epoch(epoch)` at the top of every epoch, before iterating the loader.

Observed (plain run, torchrun --nproc_per_node 2, OMP_NUM_THREADS=1)
--------------------------------------------------------------------
exit 0 after ~5.5-6 s, 12 epochs x 25 steps.  Every epoch logs the same order on each rank:
    solubility.rank0 epoch 0  ... first ids [742, 574, 1450, 986, 1462, 368] | order digest 922543
    solubility.rank0 epoch 11 ... first ids [742, 574, 1450, 986, 1462, 368] | order digest 922543
    solubility.rank1 epoch 0  ... first ids [9, 4, 180, 1110, 209, 1500] | order digest 950292
    solubility.rank1 epoch 11 ... first ids [9, 4, 180, 1110, 209, 1500] | order digest 950292
Last line: "solubility.rank0 saved model to /tmp/ddpdoctor-zoo".
"""
import gc
import logging
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = {"kind": ["missing_set_epoch"], "rank": None, "fix": ["set_epoch"], "options": []}

N_MOLS = 1600
FP_BITS = 512
EPOCHS = 12
BATCH = 32

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")


class FingerprintSet(Dataset):
    def __init__(self, n, seed=3):
        g = torch.Generator().manual_seed(seed)
        n_on = torch.randint(20, 61, (n,), generator=g)
        fp = torch.zeros(n, FP_BITS)
        for i, k in enumerate(n_on.tolist()):
            fp[i, torch.randperm(FP_BITS, generator=g)[:k]] = 1.0
        w = torch.randn(FP_BITS, generator=g) * (torch.rand(FP_BITS, generator=g) < 0.12)
        size_term = -0.04 * (n_on.float() - 40.0) - 0.002 * (n_on.float() - 40.0) ** 2
        self.fp = fp
        self.logs = (0.25 * fp @ w + size_term + 0.3 * torch.randn(n, generator=g)).unsqueeze(1)

    def __len__(self):
        return len(self.fp)

    def __getitem__(self, i):
        return i, self.fp[i], self.logs[i]


def make_model():
    return nn.Sequential(nn.Linear(FP_BITS, 256), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))


def order_digest(ids):
    pos = torch.arange(1, len(ids) + 1)
    return int((pos * ids).sum() % 1_000_003)


def train(rank, world, log):
    dataset = FingerprintSet(N_MOLS)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = DDP(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-5)
    loss_fn = nn.MSELoss()

    for epoch in range(EPOCHS):  # zoo: place
        model.train()
        seen, total = [], 0.0
        for ids, fp, y in loader:
            pred = model(fp)
            loss = loss_fn(pred, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(ids)
            total += loss.item() * len(ids)
        order = torch.cat(seen)
        log.info("epoch %d mse %.4f | first ids %s | order digest %d over %d molecules",
                 epoch, total / len(order), order[:6].tolist(), order_digest(order), len(order))
    return model


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = logging.getLogger(f"solubility.rank{rank}")
    model = train(rank, world, log)
    if rank == 0:
        out_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
        os.makedirs(out_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(out_dir, "solubility_mlp.pt"))
        log.info("saved model to %s", out_dir)
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
