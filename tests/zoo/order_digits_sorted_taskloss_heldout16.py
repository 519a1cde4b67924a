"""Multi-task glyph model whose epoch report syncs its meters worst-task-first, ranked by each
rank's own loss.

The job: 8x8 digit-like glyphs (flattened to 64 pixels, i.e. a small vision-like tabular set)
train a shared trunk with three heads: the digit (10 classes), its parity (2 classes) and the
"ink" of the glyph (a noisy regression target). Every task keeps a meter whose state is one
tensor, and the meters are of different sizes: the digit meter holds 22 numbers, the parity
meter 6 and the ink meter 4. At the end of each epoch the `EpochReport` wants the worst task
printed first, so it ranks the task names by the meters' average loss and then the meter bank
all-reduces the meters one by one in that order.

The bug: the ranking uses each rank's local average loss, before anything is reduced. For the
first epochs the losses are far apart and both ranks rank the tasks alike (the order even
changes twice, on both ranks at once, as the falling digit loss passes the other two); once the
digit and parity losses come close, the two ranks rank them differently (at epoch 6 of 14 with
these seeds), and at the same position one rank all-reduces the 6-number parity meter and the
other the 22-number digit meter. The sizes do not match and the job fails there.

Fix: rank by a fixed order (the task names) for the sync, or all-reduce the meters first and
sort the synced values only for printing.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": None, "rank": None, "fix": [], "options": ["--hang-timeout", "8", "--on-hang", "kill"]}

EPOCHS = 14


def make_glyphs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    protos = (torch.rand(10, 64, generator=g) > 0.6).float()
    digit = torch.randint(0, 10, (n,), generator=g)
    x = protos[digit] + 0.9 * torch.randn(n, 64, generator=g)
    ink = protos[digit].mean(1) * 4.0 - 1.6 + 0.55 * torch.randn(n, generator=g)
    return TensorDataset(x, digit, digit % 2, ink)


class GlyphNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU())
        self.digit = nn.Linear(32, 10)
        self.parity = nn.Linear(32, 2)
        self.ink = nn.Linear(32, 1)

    def forward(self, x):
        h = self.trunk(x)
        return self.digit(h), self.parity(h), self.ink(h).squeeze(1)


class ClassMeter:
    """loss sum, count, then correct and seen per class."""

    def __init__(self, num_classes):
        self.c = num_classes
        self.state = torch.zeros(2 + 2 * num_classes)

    def update(self, logits, target):
        self.state[0] += F.cross_entropy(logits, target, reduction="sum")
        self.state[1] += target.numel()
        hit = (logits.argmax(1) == target).float()
        self.state[2:2 + self.c] += torch.zeros(self.c).index_add_(0, target, hit)
        self.state[2 + self.c:] += torch.bincount(target, minlength=self.c).float()

    def local_loss(self):
        return (self.state[0] / self.state[1]).item()

    def summary(self):
        acc = self.state[2:2 + self.c].sum() / self.state[1]
        return f"loss {self.state[0] / self.state[1]:.3f} acc {acc:.3f}"


class RegressionMeter:
    """loss (mse) sum, count, absolute error sum, target sum."""

    def __init__(self):
        self.state = torch.zeros(4)

    def update(self, pred, target):
        self.state[0] += F.mse_loss(pred, target, reduction="sum")
        self.state[1] += target.numel()
        self.state[2] += (pred - target).abs().sum()
        self.state[3] += target.sum()

    def local_loss(self):
        return (self.state[0] / self.state[1]).item()

    def summary(self):
        return f"mse {self.state[0] / self.state[1]:.3f} mae {self.state[2] / self.state[1]:.3f}"


class MeterBank:
    def __init__(self):
        self.meters = {"digit": ClassMeter(10), "parity": ClassMeter(2), "ink": RegressionMeter()}

    def sync(self, names):
        for name in names:
            dist.all_reduce(self.meters[name].state)


class EpochReport:
    def __init__(self, bank):
        self.bank = bank

    def worst_first(self):
        meters = self.bank.meters
        return sorted(meters, key=lambda n: meters[n].local_loss(), reverse=True)  # zoo: place

    def emit(self, epoch, rank):
        order = self.worst_first()
        self.bank.sync(order)
        if rank == 0:
            lines = ", ".join(f"{n}: {self.bank.meters[n].summary()}" for n in order)
            print(f"epoch {epoch} | {lines}", flush=True)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = make_glyphs(1024)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = DDP(GlyphNet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        bank = MeterBank()
        for x, digit, parity, ink in loader:
            d_logits, p_logits, ink_pred = model(x)
            loss = (F.cross_entropy(d_logits, digit) + F.cross_entropy(p_logits, parity)
                    + F.mse_loss(ink_pred, ink))
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                bank.meters["digit"].update(d_logits, digit)
                bank.meters["parity"].update(p_logits, parity)
                bank.meters["ink"].update(ink_pred, ink)
        EpochReport(bank).emit(epoch, rank)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
