"""Healthy twin: bearing-fault classifier (1-D conv net on vibration snippets) whose learning
rate is cut by ReduceLROnPlateau(mode="max") when validation accuracy stalls. Each rank scores
its own half of the validation set, but the correct/total counts are all-reduced before the
accuracy is computed, so every rank feeds the scheduler the same global number and cuts its
learning rate at the same epoch; the replicas stay identical."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

SNIPPET = 96


def vibration_snippets(n: int, seed: int) -> TensorDataset:
    """Healthy shaft rotation plus, for faulty bearings, periodic impacts at a fault frequency."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(SNIPPET, dtype=torch.float32)
    label = torch.randint(0, 4, (n,), generator=g)  # 0 healthy, 1 inner race, 2 outer race, 3 ball
    period = torch.tensor([0.0, 9.0, 14.0, 21.0])[label]
    phase = torch.rand(n, generator=g) * 20
    shaft = torch.sin(2 * torch.pi * t[None] / 32 + phase[:, None])
    impact_t = torch.remainder(t[None] + phase[:, None], period.clamp(min=1.0)[:, None])
    impacts = torch.where(period[:, None] > 0, torch.exp(-0.7 * impact_t), torch.zeros(()))
    x = shaft + 2.0 * impacts + 0.3 * torch.randn(n, SNIPPET, generator=g)
    return TensorDataset(x[:, None, :], label)


class FaultNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(1, 12, 9, padding=4), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(12, 16, 5, padding=2), nn.ReLU(), nn.AdaptiveMaxPool1d(3),
        )
        self.fc = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).flatten(1))


@torch.no_grad()
def global_accuracy(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64)
    for x, y in loader:
        counts[0] += (model(x).argmax(1) == y).sum()
        counts[1] += len(y)
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    train_set, val_set = vibration_snippets(1600, seed=31), vibration_snippets(400, seed=32)
    sampler = DistributedSampler(train_set, shuffle=True, seed=5)
    train_loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=100, sampler=DistributedSampler(val_set, shuffle=False))

    model = DDP(FaultNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0, threshold=0.002)

    for epoch in range(9):
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        val_acc = global_accuracy(model.module, val_loader)
        sched.step(val_acc)
        if rank == 0:
            print(f"epoch {epoch} val_acc {val_acc:.3f} lr {opt.param_groups[0]['lr']:g}", flush=True)

    checksum = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"[rank {rank}] final weight checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
