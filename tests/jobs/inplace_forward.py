"""A forward that changes a weight in place, and twins that must stay quiet: one mode per argv[1].

max_norm      nn.Embedding(max_norm=1.0): each forward renormalises the rows its batch looked
              up, in place, and each rank's batch looks up its own rows: the replicas part
renorm_after  no max_norm; after each optimizer step every rank renormalises the whole table
              (in place, after wrapping, alike everywhere): nothing to say
clamp_in      the forward clamps the head's weight in place, the same on every rank: the
              change is on record, the replicas stay equal, nothing to say
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Tagger(nn.Module):
    def __init__(self, max_norm: float | None, clamp: bool) -> None:
        super().__init__()
        self.table = nn.Embedding(64, 8, max_norm=max_norm)
        self.head = nn.Linear(8, 4)
        self.clamp = clamp

    def forward(self, ids):
        if self.clamp:
            with torch.no_grad():
                self.head.weight.clamp_(-0.3, 0.3)
        return self.head(self.table(ids).mean(1))


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, 64, (96, 3)), torch.randint(0, 4, (96,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    net = Tagger(1.0 if mode == "max_norm" else None, mode == "clamp_in")
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for ids, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(ids), y).backward()
            opt.step()
            if mode == "renorm_after":
                with torch.no_grad():
                    net.table.weight.renorm_(2, 0, 1.0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
