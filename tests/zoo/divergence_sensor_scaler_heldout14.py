"""Fault classifier on sensor readings with a built-in input scaler that keeps running
statistics as buffers. The job wraps the model with ``forward_sync_buffers=False`` (the newer
spelling of ``broadcast_buffers=False``), so each rank's scaler learns the statistics of its own
shard only: the parameters stay in step (their gradients are averaged), but the scaler buffers,
which every forward and the saved checkpoint depend on, end up different on the two ranks.
Nothing raises."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": [],
    "options": [],
    "names": [["scaler.mean", "scaler.var"]],
}


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


def load_readings(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    offsets = torch.tensor([20.0, -5.0, 100.0, 0.5, 3.0, 40.0, -12.0, 7.5])
    scales = torch.tensor([4.0, 1.0, 25.0, 0.1, 2.0, 10.0, 3.0, 1.5])
    x = offsets + scales * torch.randn(n, 8, generator=g)
    y = ((x[:, 0] - 20) / 4 + (x[:, 2] - 100) / 25 > 0).long() + ((x[:, 5] - 40) / 10 > 1).long()
    return TensorDataset(x, y)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    data = load_readings(768)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)

    # the scaler and BatchNorm keep their own statistics; skip the per-forward buffer broadcast
    model = DDP(FaultNet(8, 3), forward_sync_buffers=False)  # zoo: place
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

    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/fault_net.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
