"""Validation meter whose tensor dtype depends on whether the rank saw any batch (mismatch).

Story: `Trainer.validate` averages the validation loss with a small `MeanMeter` that keeps
`self.total = 0` and `self.count = 0` as Python numbers and adds `loss.item() * n` per
batch.  `MeanMeter.sync()` packs them with `torch.tensor([self.total, self.count])` and
all-reduces.  The validation files are sharded by file, `VAL_FILES[rank::world]`, and last
week the validation set was re-exported as ONE file.  Rank 0 gets it; rank 1 gets no file,
so its meter never sees a float: `torch.tensor([0, 0])` is int64 while rank 0's
`torch.tensor([123.4, 64])` is float32.  At the end of epoch 0 both ranks enter the same
all_reduce (same sequence number, same element count) with different dtypes (8 vs 16
bytes): gloo cannot match them and aborts ("Received data size doesn't match expected
size"), or, on another backend, the job hangs or reduces garbage.

Root cause: the meter's tensor dtype is rank-dependent (int64 on the rank with an empty
validation shard, float32 elsewhere).
Right diagnosis: collective mismatch at the validation all_reduce in MeanMeter.sync: the
ranks disagree on the dtype (float32 vs int64).
Fix: build the tensor with an explicit dtype (`torch.tensor([...], dtype=torch.float64)`) /
start the sums as floats (0.0); and shard validation so every rank has data.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": ["dtype", "float", "same type", "cast"],
    "names": [["dtype", "float32", "int64"]],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

TRAIN_FILES = ["train-00000", "train-00001", "train-00002", "train-00003"]
VAL_FILES = ["val-00000"]  # re-exported as a single file


def load_file(name, n=96):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    return TensorDataset(x, y)


class MeanMeter:
    def __init__(self):
        self.total = 0
        self.count = 0

    def update(self, value, n):
        self.total += value * n
        self.count += n

    def sync(self):
        t = torch.tensor([self.total, self.count])
        dist.all_reduce(t)  # zoo: place
        return (t[0] / max(t[1].item(), 1)).item()


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
        return meter.sync()  # zoo: place


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
