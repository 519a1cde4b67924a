"""HEALTHY twin of mismatch_val_meter_dtype: one rank has no validation data, done right.

Story: the same single-file validation set sharded by file (`VAL_FILES[rank::world]`), so
rank 1 validates nothing.  But `MeanMeter` starts its sums as floats and `sync()` builds its
tensor with an explicit `dtype=torch.float64`, so both ranks all-reduce the same
signature: rank 1 contributes (0.0, 0.0) and the mean is right.  Looks risky (a rank with
an empty shard joins a metric collective) but is correct; no hang, exits 0.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None

TRAIN_FILES = ["train-00000", "train-00001", "train-00002", "train-00003"]
VAL_FILES = ["val-00000"]  # re-exported as a single file


def load_file(name, n=96):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    return TensorDataset(x, y)


class MeanMeter:
    def __init__(self):
        self.total = 0.0
        self.count = 0.0

    def update(self, value, n):
        self.total += value * n
        self.count += n

    def sync(self):
        t = torch.tensor([self.total, self.count], dtype=torch.float64)
        dist.all_reduce(t)
        return (t[0] / t[1].clamp(min=1)).item()


class Trainer:
    def __init__(self, rank, world):
        self.rank = rank
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
        self.model = DDP(net)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        train = ConcatDataset([load_file(f) for f in TRAIN_FILES])
        self.sampler = DistributedSampler(train, shuffle=True, seed=0)
        self.loader = DataLoader(train, batch_size=16, sampler=self.sampler)
        self.val_sets = [load_file(f, n=64) for f in VAL_FILES[rank::world]]

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        for x, y in self.loader:
            loss = F.cross_entropy(self.model(x), y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()

    def validate(self):
        meter = MeanMeter()
        net = self.model.module
        net.eval()
        with torch.no_grad():
            for ds in self.val_sets:
                for x, y in DataLoader(ds, batch_size=32):
                    meter.update(F.cross_entropy(net(x), y).item(), len(y))
        net.train()
        return meter.sync()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(rank, world)
    for epoch in range(3):
        trainer.train_epoch(epoch)
        val = trainer.validate()
        if rank == 0:
            print(f"epoch {epoch} val_loss {val:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
