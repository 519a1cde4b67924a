"""An IterableDataset that splits FILES across ranks, and the files differ in size (uneven).

Story: a click-log model streams records from part files with a `PartFileStream`
IterableDataset.  Sharding is by file (`self.files[rank::world]`, the usual recipe for
iterable datasets), but the export wrote parts of very different sizes: rank 0 gets
part-0 and part-2 (520 records, 13 batches), rank 1 gets part-1 only (120 records, 3
batches).  After its 3rd batch rank 1 leaves the loop and enters the end-of-epoch metric
all_reduce; rank 0 goes on to step 3 whose gradient all-reduce has no partner.  The job
hangs (or gloo fails on the mismatched all-reduce).

Root cause: uneven inputs -- rank 1 runs out of batches first (file-level sharding of
unequal files).
Right diagnosis: uneven inputs: rank 1 finished its data pass after 3 batches while rank 0
went on training.
Fix: balance the shards (split by record, not by file; pad / cap every rank to the same
number of batches) or wrap the loop in `Join([model])`.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["join", "same number", "rebalance", "balance the", "pad", "drop_last", "split by record", "per record"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

PART_FILES = {"part-0": 320, "part-1": 120, "part-2": 200}
N_FEAT = 24


def read_part(name, n):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    for _ in range(n):
        x = torch.randn(N_FEAT, generator=g)
        yield x, torch.tensor(float(x[:6].sum() > 0))


class PartFileStream(IterableDataset):
    def __init__(self, files, rank, world):
        self.files = sorted(files)[rank::world]
        self.sizes = files

    def __iter__(self):
        for name in self.files:
            yield from read_part(name, self.sizes[name])


class CTRModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_FEAT, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                 nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(CTRModel())
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    loader = DataLoader(PartFileStream(PART_FILES, rank, world), batch_size=40)
    for epoch in range(2):
        total = torch.zeros(2)
        for _step, (x, y) in enumerate(loader):
            loss = F.binary_cross_entropy_with_logits(model(x), y)  # zoo: place
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(y), len(y)])
        dist.all_reduce(total)  # zoo: place
        if rank == 0:
            print(f"epoch {epoch} logloss {total[0] / total[1]:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
