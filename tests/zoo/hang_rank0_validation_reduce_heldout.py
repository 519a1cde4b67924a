"""Rank-0-only validation that calls a collective inside (hang).

The user trains a small MLP classifier with a Trainer class.  To "save time",
validation runs on rank 0 only (`if self.is_main: self.validate()`), followed by
a `dist.barrier()` so the other ranks wait for it.  But `validate()` reuses the
`reduce_mean()` helper from the distributed metrics module, which does a
`dist.all_reduce` to average the accuracy across ranks.  Rank 0 therefore sits
in an all_reduce that no other rank will ever join, while rank 1 sits in the
barrier after the validation block: the job hangs after the first epoch.

Root cause: rank 0 (it issues the extra all_reduce inside validate()).
Right diagnosis: hang; rank 0 is blocked in an all_reduce called from
validate()/reduce_mean() while rank 1 waits in barrier.
Fix: run validation on every rank (each on its shard) so the all_reduce is
matched, or drop the collective from the rank-0-only path.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = {
    "kind": None,
    "rank": 0,
    "fix": ["every rank", "all ranks", "each rank", "reduce_mean", "validate",
            "rank-0-only", "only on rank 0", "remove the all_reduce"],
    "names": [["validate", "reduce_mean"]],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


def reduce_mean(value: float) -> float:
    """Average a python float over all ranks (metrics helper)."""
    t = torch.tensor([value], dtype=torch.float32)
    dist.all_reduce(t)  # zoo: place
    return t.item() / dist.get_world_size()


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    w = torch.randn(20, 4, generator=g)
    y = (x @ w).argmax(dim=1)
    return TensorDataset(x, y)


class Trainer:
    def __init__(self, rank, world):
        self.rank = rank
        self.is_main = rank == 0
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
        self.model = DDP(net)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.train_ds = make_data(1024, 1)
        self.val_ds = make_data(256, 2)
        self.sampler = DistributedSampler(self.train_ds, num_replicas=world, rank=rank)
        self.loader = DataLoader(self.train_ds, batch_size=32, sampler=self.sampler)
        self.loss_fn = nn.CrossEntropyLoss()

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.model.train()
        for x, y in self.loader:
            self.opt.zero_grad()
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            self.opt.step()
        return loss.item()

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        correct = 0
        for x, y in DataLoader(self.val_ds, batch_size=64):
            correct += (net(x).argmax(1) == y).sum().item()
        acc = correct / len(self.val_ds)
        return reduce_mean(acc)

    def fit(self, epochs):
        for epoch in range(epochs):
            last = self.train_epoch(epoch)
            if self.is_main:
                acc = self.validate()
                print(f"epoch {epoch} loss {last:.3f} val_acc {acc:.3f}", flush=True)
            dist.barrier()


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    trainer = Trainer(dist.get_rank(), dist.get_world_size())
    trainer.fit(epochs=3)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
