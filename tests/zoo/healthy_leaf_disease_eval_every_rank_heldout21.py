"""Leaf-disease classifier validated on every rank through model.module, metrics all-reduced.

Story: a small CNN classifies 3x24x24 leaf crops into healthy / rust / blight / mildew.  At the
end of each epoch every rank evaluates its half of the held-out crops (a DistributedSampler
without shuffling), running the forward through `model.module` inside `torch.no_grad()` with
the model in eval mode (so BatchNorm uses its running statistics and DDP's forward, with its
buffer broadcast, is not involved).  Each rank sums loss, hits and count, one all_reduce
combines them, and rank 0 prints the global accuracy.  Both ranks evaluate the same number of
crops, so neither waits long for the other at the all_reduce.

Healthy twin of the "evaluation on rank 0 only / through the DDP wrapper" mistakes: no warning
or error expected.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = None

DISEASES = 4


def crops(n, seed):
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, DISEASES, (n,), generator=g)
    tint = torch.tensor([[0.0, 0.4, 0.0], [0.4, 0.2, 0.0], [0.2, 0.1, 0.0], [0.3, 0.3, 0.3]])
    x = torch.randn(n, 3, 24, 24, generator=g) * 0.8 + tint[label][:, :, None, None]
    spots = (torch.rand(n, 1, 24, 24, generator=g) < 0.05 * label[:, None, None, None]).float()
    return TensorDataset(x - 0.5 * spots, label)


class LeafNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                                  nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(32, DISEASES)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


def evaluate(model, loader):
    model.eval()
    stats = torch.zeros(3)  # loss sum, hits, count
    with torch.no_grad():
        for x, y in loader:
            logits = model.module(x)
            stats += torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                                   (logits.argmax(-1) == y).sum().item(), len(y)])
    model.train()
    dist.all_reduce(stats)
    return stats[0] / stats[2], stats[1] / stats[2]


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(LeafNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    train, val = crops(1024, seed=1), crops(256, seed=2)
    train_sampler = DistributedSampler(train, shuffle=True, seed=3)
    train_loader = DataLoader(train, batch_size=32, sampler=train_sampler)
    val_loader = DataLoader(val, batch_size=64, sampler=DistributedSampler(val, shuffle=False))
    for epoch in range(4):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        val_loss, val_acc = evaluate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.3f}, val acc {val_acc:.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
