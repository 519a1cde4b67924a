"""Rank 1's last batch holds a single sample and BatchNorm refuses it (crash on rank 1).

Story: a sensor model is trained on recording sessions; `session_shard` gives each rank
whole sessions (`SESSIONS[rank::world]`) so that no session is split.  The per-rank totals
happen to be 66 and 65 windows, so with `batch_size=32` and the default `drop_last=False`
both ranks run 3 steps per epoch -- but rank 1's third batch has ONE window.  The model has
a `BatchNorm1d` after its first layer, and in training mode BatchNorm cannot normalize a
single value per channel: rank 1 raises `ValueError: Expected more than 1 value per
channel when training` in the forward of step 2.  Rank 0 is waiting in that step's
gradient all-reduce and fails afterwards as a consequence.

Root cause: rank 1 (uncaught ValueError from BatchNorm on a 1-sample batch).
Right diagnosis: rank 1 failed first with the ValueError in SensorNet.forward (the bn line),
called from the training step; rank 0's error is a consequence.
Fix: `drop_last=True` on the training loader (or avoid 1-sample batches: pad / rebalance the
shards so no batch has a single sample).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["drop_last", "batch size 1", "batch of 1", "batch of one", "single sample",
            "one sample", "1 sample", "more than 1 value", "batchnorm", "batch_size"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

SESSIONS = {"s01": 40, "s02": 33, "s03": 26, "s04": 32}  # windows per recording session


def load_session(name, n):
    g = torch.Generator().manual_seed(int(name[1:]))
    x = torch.randn(n, 18, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def session_shard(rank, world):
    names = sorted(SESSIONS)[rank::world]
    return ConcatDataset([load_session(n, SESSIONS[n]) for n in names])


class SensorNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(18, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.fc1(x)))  # zoo: place
        return self.fc2(h)


class Trainer:
    def __init__(self, rank, world):
        torch.manual_seed(0)
        self.model = DDP(SensorNet())
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.loader = DataLoader(session_shard(rank, world), batch_size=32, shuffle=True,
                                 generator=torch.Generator().manual_seed(rank))

    def train_step(self, x, y):
        loss = F.cross_entropy(self.model(x), y)  # zoo: place
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def fit(self, epochs):
        for epoch in range(epochs):
            for x, y in self.loader:
                loss = self.train_step(x, y)  # zoo: place
            print(f"epoch {epoch} loss {loss:.3f}", flush=True)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    Trainer(rank, world).fit(epochs=3)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
