"""House-price regressor with a plateau scheduler. No error, no hang, yet the replicas end
with different weights: each rank feeds ReduceLROnPlateau the validation loss of its own
shard, so the ranks cut their learning rate at different epochs (rank 0 after epoch 5, rank 1
after epoch 6), and for the steps in between they apply the same averaged gradient with
different step sizes."""

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
    "names": [["learning rate", "lr ", "lr=", "scheduler", "ReduceLROnPlateau"]],
    "never": ["loaded after wrapping"],
}


def make_listings(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    w = torch.linspace(-1.0, 1.0, 12)
    price = x @ w + 0.5 * torch.sin(3 * x[:, 0]) + 0.3 * torch.randn(n, generator=g)
    return TensorDataset(x, price[:, None])


class PriceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Trainer:
    def __init__(self, model: nn.Module, train: TensorDataset, val: TensorDataset) -> None:
        self.rank = dist.get_rank()
        self.model = DDP(model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(self.opt, factor=0.5, patience=0)
        self.train_sampler = DistributedSampler(train, shuffle=True, seed=0)
        self.train_loader = DataLoader(train, batch_size=32, sampler=self.train_sampler)
        self.val_loader = DataLoader(val, batch_size=64, sampler=DistributedSampler(val, shuffle=False))

    def train_epoch(self, epoch: int) -> float:
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        total, n = 0.0, 0
        for x, y in self.train_loader:
            self.opt.zero_grad()
            loss = nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.opt.step()
            total += loss.item() * len(y)
            n += len(y)
        return total / n

    @torch.no_grad()
    def validate(self) -> float:
        self.model.eval()
        total, n = 0.0, 0
        for x, y in self.val_loader:
            total += nn.functional.mse_loss(self.model.module(x), y, reduction="sum").item()
            n += len(y)
        return total / n

    def fit(self, epochs: int) -> None:
        for epoch in range(epochs):
            train_loss = self.train_epoch(epoch)
            val_loss = self.validate()
            self.sched.step(val_loss)  # zoo: place
            if self.rank == 0:
                lr = self.opt.param_groups[0]["lr"]
                print(f"epoch {epoch}: train {train_loss:.4f} val {val_loss:.4f} lr {lr:g}", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    trainer = Trainer(PriceNet(), make_listings(1024, seed=1), make_listings(256, seed=2))
    trainer.fit(epochs=8)
    model = trainer.model
    if trainer.rank == 0:
        torch.save(model.module.state_dict(), "/tmp/price_net.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
