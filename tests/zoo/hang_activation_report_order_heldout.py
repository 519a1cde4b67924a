"""Activation report all-reduces branches in an order sorted by LOCAL statistics (hang).

Story: an `ActivationMonitor` keeps, through forward hooks, the per-channel peak activation
of each of three parallel feature branches (widths 96, 64, 80).  Every 5 steps `report()`
logs the branches "hottest first" (to spot saturation): it sorts the branches by their
LOCAL peak activation and then all-reduces (MAX) each branch's per-channel vector to log the
global peaks.  The branches' peaks are close and each rank sees its own batch, so the order
differs between the ranks: at the first report where they differ, rank 0 all-reduces e.g.
a 96-vector while rank 1 all-reduces a 64-vector at the same collective number.  The job
hangs or gloo fails on the size.

Root cause: the collective order is decided by rank-local values (no single root rank).
Right diagnosis: ranks disagree on the all_reduce's size/tensor at the same sequence number
in ActivationMonitor.report (collective order mismatch).
Fix: iterate the blocks in a fixed order (sorted by name / registration order), or
all-reduce all the statistics first and sort by the global values.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": ["order", "sorted", "sort", "fixed", "same sequence", "deterministic", "global"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


class Block(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


class Net(nn.Module):
    """Three parallel feature branches of different widths over the same input."""

    def __init__(self):
        super().__init__()
        self.branch_a = Block(32, 96)
        self.branch_b = Block(32, 64)
        self.branch_c = Block(32, 80)
        self.out = nn.Linear(96 + 64 + 80, 5)

    def forward(self, x):
        return self.out(torch.cat([self.branch_a(x), self.branch_b(x), self.branch_c(x)], -1))


class ActivationMonitor:
    def __init__(self, net, names):
        self.stats = {}
        for name in names:
            getattr(net, name).register_forward_hook(self._hook(name))

    def _hook(self, name):
        def hook(module, inputs, output):
            self.stats[name] = output.detach().amax(0)  # per-channel peak

        return hook

    def report(self):
        hottest = sorted(self.stats, key=lambda n: self.stats[n].max().item(), reverse=True)
        out = {}
        for name in hottest:
            t = self.stats[name].clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # zoo: place
            out[name] = round(t.mean().item(), 4)
        return out


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    monitor = ActivationMonitor(net, ["branch_a", "branch_b", "branch_c"])
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1024, 32, generator=g)
    y = torch.randint(0, 5, (1024,), generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (xb, yb) in enumerate(loader):
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 5 == 4:
                report = monitor.report()  # zoo: place
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.3f} act {report}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
