"""HEALTHY: rank-0 evaluation through model.module, early stopping broadcast to all ranks.

After every epoch rank 0 evaluates on a held-out set with
`model.module.eval()` under `torch.no_grad()` (no DDP wrapper, so no
collectives), decides whether to stop (`EarlyStopping`, patience 2), and the
decision is broadcast from rank 0 so that every rank leaves the loop at the
same epoch.  Rank 1 meanwhile waits in that broadcast.  Looks like
"rank-0-only validation" and "early stopping", but the decision is made once
and shared, so all ranks run the same collectives.  Exits 0 (it stops early
or after 8 epochs).

Expected: no warning, no error.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = None


class EarlyStopping:
    def __init__(self, patience=2, min_delta=1e-3):
        self.best = float("inf")
        self.bad = 0
        self.patience = patience
        self.min_delta = min_delta

    def step(self, metric):
        if metric < self.best - self.min_delta:
            self.best, self.bad = metric, 0
        else:
            self.bad += 1
        return self.bad >= self.patience


def make(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, :2].prod(1) > 0).long()
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train = make(640, 0)
    sampler = DistributedSampler(train, world, rank)
    loader = DataLoader(train, batch_size=32, sampler=sampler, drop_last=True)
    val_loader = DataLoader(make(256, 1), batch_size=128)
    stopper = EarlyStopping()
    for epoch in range(8):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        stop = torch.zeros(1)
        if rank == 0:
            net = model.module
            net.eval()
            with torch.no_grad():
                vl = sum(nn.functional.cross_entropy(net(x), y, reduction="sum").item()
                         for x, y in val_loader) / 256
            net.train()
            stop[0] = float(stopper.step(vl))
            print(f"epoch {epoch} val_loss {vl:.4f} stop={bool(stop.item())}", flush=True)
        dist.broadcast(stop, src=0)
        if stop.item():
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
