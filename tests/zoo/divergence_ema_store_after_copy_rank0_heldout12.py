"""Image-patch classifier with an exponential moving average of the weights. Every 40 steps rank 0
swaps the EMA weights in to evaluate them, but stores the live weights only after copying the
EMA ones over them, so restore() puts the EMA weights back: from then on rank 0 trains from
different weights than rank 1, with no error (DDP only averages gradients)."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": "weights_diverged",
    "rank": 0,
    "fix": ["broadcast", "every rank", "all ranks", "restore"],
    "options": [],
}

EVAL_EVERY = 40


class ModelEMA:
    def __init__(self, model, decay=0.99):
        self.decay = decay
        self.shadow = [p.detach().clone() for p in model.parameters()]
        self.backup = None

    @torch.no_grad()
    def update(self, model):
        for s, p in zip(self.shadow, model.parameters()):
            s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    @torch.no_grad()
    def store(self, model):
        self.backup = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def copy_to(self, model):
        for s, p in zip(self.shadow, model.parameters()):
            p.copy_(s)

    @torch.no_grad()
    def restore(self, model):
        for b, p in zip(self.backup, model.parameters()):
            p.copy_(b)


class PatchNet(nn.Module):
    def __init__(self, n_classes=6):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(32, n_classes)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def make_patches(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 6, (n,), generator=g)
    base = torch.randn(6, 3, 12, 12, generator=g)
    x = base[y] + 0.9 * torch.randn(n, 3, 12, 12, generator=g)
    return TensorDataset(x, y)


@torch.no_grad()
def evaluate(net, loader):
    net.eval()
    correct = total = 0
    for x, y in loader:
        correct += (net(x).argmax(1) == y).sum().item()
        total += len(y)
    net.train()
    return correct / total


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    train = make_patches(2560, seed=1)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=32, sampler=sampler, drop_last=True)
    val_loader = DataLoader(make_patches(64, seed=1), batch_size=64)

    model = DDP(PatchNet())
    ema = ModelEMA(model.module)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    step = 0
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ema.update(model.module)
            step += 1
            if rank == 0 and step % EVAL_EVERY == 0:
                ema.copy_to(model.module)  # zoo: place
                ema.store(model.module)
                acc = evaluate(model.module, val_loader)
                ema.restore(model.module)
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} ema val acc {acc:.3f}", flush=True)
    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/patchnet_ema_heldout12.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
