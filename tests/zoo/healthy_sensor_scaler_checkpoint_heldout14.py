"""Healthy twin: the sensor fault classifier with its running input scaler (buffers) and a
BatchNorm layer, wrapped with DDP's default buffer handling, so rank 0's buffers reach every
rank before each forward. Rank 0 alone writes a checkpoint at the end of every epoch and the
others wait for it at a barrier; at the end every rank scores its shard of the test set through the
wrapper (which hands rank 0's buffers to all first) and all ranks all-reduce the totals."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


class RunningScaler(nn.Module):
    """Standardises inputs with running mean/variance estimated during training."""

    def __init__(self, dim: int, momentum: float = 0.05) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.lerp_(x.mean(0), self.momentum)
                self.var.lerp_(x.var(0, unbiased=False), self.momentum)
        return (x - self.mean) / (self.var + 1e-5).sqrt()


class FaultNet(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.scaler = RunningScaler(channels)
        self.mlp = nn.Sequential(
            nn.Linear(channels, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.scaler(x))


def load_readings(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([20.0, -5.0, 100.0, 0.5, 3.0, 40.0, -12.0, 7.5])
    scales = torch.tensor([4.0, 1.0, 25.0, 0.1, 2.0, 10.0, 3.0, 1.5])
    x = offsets + scales * torch.randn(n, 8, generator=g)
    y = ((x[:, 0] - 20) / 4 + (x[:, 2] - 100) / 25 > 0).long() + ((x[:, 5] - 40) / 10 > 1).long()
    return TensorDataset(x, y)


def save_checkpoint(model: DDP, opt: torch.optim.Optimizer, epoch: int, folder: str) -> None:
    state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch}
    tmp = os.path.join(folder, "last.pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(folder, "last.pt"))


@torch.no_grad()
def evaluate(net: nn.Module, loader: DataLoader) -> float:
    net.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    for x, y in loader:
        totals += torch.tensor([(net(x).argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
    net.train()
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    folder = os.path.join(tempfile.gettempdir(), "fault_net_ckpt")
    if rank == 0:
        os.makedirs(folder, exist_ok=True)

    data = load_readings(768, seed=7)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    test = load_readings(256, seed=8)
    test_loader = DataLoader(test, batch_size=64, sampler=DistributedSampler(test, shuffle=False))

    model = DDP(FaultNet(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)

    for epoch in range(3):
        sampler.set_epoch(epoch)
        model.train()
        total, n = 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item() * len(y)
            n += len(y)
        if rank == 0:
            print(f"epoch {epoch}: loss {total / n:.4f}", flush=True)
            save_checkpoint(model, opt, epoch, folder)
        dist.barrier()

    acc = evaluate(model, test_loader)
    if rank == 0:
        print(f"test accuracy {acc:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
