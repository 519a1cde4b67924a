"""HEALTHY twin of hang_activation_report_order: the "hottest branches" report, done right.

Story: the same `ActivationMonitor` (forward hooks, per-channel peak activation of three
parallel branches of different widths) logs the branches hottest first every 5 steps.  Here
`report()` first all-reduces (MAX) one fixed-size vector of the branches' local peaks, in
registration order, and sorts by the GLOBAL peaks; only then does it all-reduce each
branch's per-channel vector in that (now identical) order.  The code still sorts by
activations and issues collectives in a data-dependent order, which looks dangerous, but
every rank computes the same order.  No hang, exits 0.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None


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
        self.names = list(names)
        self.stats = {}
        for name in names:
            getattr(net, name).register_forward_hook(self._hook(name))

    def _hook(self, name):
        def hook(module, inputs, output):
            self.stats[name] = output.detach().amax(0)  # per-channel peak

        return hook

    def report(self):
        peaks = torch.stack([self.stats[n].max() for n in self.names])
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        order = torch.argsort(peaks, descending=True).tolist()
        out = {}
        for i in order:
            name = self.names[i]
            t = self.stats[name].clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
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
                report = monitor.report()
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.3f} act {report}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
