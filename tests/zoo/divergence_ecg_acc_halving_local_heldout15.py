"""ECG beat classifier (1-D conv net) with a hand-written "halve the learning rate when
validation accuracy stops improving" rule. No error, no hang, yet the replicas end with
different weights: each rank measures accuracy on its own half of the validation set and
never all-reduces the counts, so the two ranks decide to halve their learning rate at
different epochs and from then on apply the same averaged gradient with different step sizes."""

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
    "names": [["learning rate", "lr ", "lr=", "'lr'", "halv", "scheduler"]],
    "never": [],
}

BEAT_LEN = 128


def synth_beats(n: int, seed: int) -> TensorDataset:
    """Three beat morphologies: normal, wide QRS, premature (shifted) beat."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(-1.0, 1.0, BEAT_LEN)
    label = torch.randint(0, 3, (n,), generator=g)
    width = torch.where(label == 1, 0.12, 0.05) * (1 + 0.25 * torch.rand(n, generator=g))
    shift = torch.where(label == 2, -0.25, 0.0) + 0.12 * torch.randn(n, generator=g)
    qrs = torch.exp(-((t[None] - shift[:, None]) ** 2) / (2 * width[:, None] ** 2))
    p_wave = 0.2 * torch.exp(-((t[None] - shift[:, None] + 0.4) ** 2) / 0.01)
    noise = 0.25 * torch.randn(n, BEAT_LEN, generator=g)
    return TensorDataset((qrs + p_wave + noise)[:, None, :], label)


class BeatNet(nn.Module):
    def __init__(self, n_classes: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, 8, 7, padding=3), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(8, 16, 5, padding=2), nn.ReLU(), nn.AdaptiveAvgPool1d(4),
        )
        self.classifier = nn.Linear(64, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


@torch.no_grad()
def accuracy(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct, total = 0, 0
    for x, y in loader:
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
    model.train()
    return correct / total


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    train_set, val_set = synth_beats(1536, seed=11), synth_beats(400, seed=12)
    sampler = DistributedSampler(train_set, shuffle=True, seed=3)
    train_loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=100, sampler=DistributedSampler(val_set, shuffle=False))

    model = DDP(BeatNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    best_acc, patience, bad_epochs = 0.0, 0, 0

    for epoch in range(10):
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        val_acc = accuracy(model.module, val_loader)
        if val_acc > best_acc + 0.002:
            best_acc, bad_epochs = val_acc, 0
        else:
            bad_epochs += 1
        if bad_epochs > patience:
            for group in opt.param_groups:
                group["lr"] *= 0.5  # zoo: place
            bad_epochs = 0
        print(f"[rank {rank}] epoch {epoch} val_acc {val_acc:.3f} lr {opt.param_groups[0]['lr']:g}", flush=True)

    checksum = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"[rank {rank}] final weight checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
