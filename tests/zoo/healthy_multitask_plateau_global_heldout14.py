"""Healthy twin: the multi-task model (species classification + age and weight regression)
with a per-task report, a validation pass and a plateau scheduler. Every rank syncs the task
meters in the same fixed order and the report is ranked hardest-first only after the sync; the
validation totals, including a count of rows without an age label (all on one rank's shard),
are all-reduced by every rank unconditionally, and ReduceLROnPlateau is fed the global
validation loss, so every rank cuts its learning rate at the same epoch."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

SPECIES = 3


def make_animals(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    species = (x[:, :SPECIES] + 1.0 * torch.randn(n, SPECIES, generator=g)).argmax(1)
    age = (x[:, 6] * 0.7 + x[:, 7] * x[:, 8] * 0.5 + 0.85 * torch.randn(n, generator=g))[:, None]
    weight = (
        x[:, 9] - 0.6 * x[:, 10] + 0.3 * torch.sin(2 * x[:, 11]) + 0.5 * torch.randn(n, generator=g)
    )[:, None]
    return TensorDataset(x, species, age, weight)


class MultiTaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.species = nn.Linear(64, SPECIES)
        self.age = nn.Linear(64, 1)
        self.weight = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {"species": self.species(h), "age": self.age(h), "weight": self.weight(h)}


class Meter:
    """Sums of one task's statistics; ``sync`` makes them global."""

    def __init__(self, fields: tuple[str, ...]) -> None:
        self.fields = fields
        self.sums = torch.zeros(len(fields), dtype=torch.float64)

    def add(self, **values: float) -> None:
        self.sums += torch.tensor([values[f] for f in self.fields], dtype=torch.float64)

    def mean_loss(self) -> float:
        return (self.sums[0] / self.sums[-1]).item()

    def sync(self) -> None:
        dist.all_reduce(self.sums)

    def reset(self) -> None:
        self.sums.zero_()


class Trainer:
    def __init__(self, train: TensorDataset, val: TensorDataset) -> None:
        self.rank = dist.get_rank()
        self.model = DDP(MultiTaskNet())
        self.opt = torch.optim.Adam(self.model.parameters(), lr=2e-3)
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self.opt, factor=0.5, patience=0, threshold=0.03
        )
        self.sampler = DistributedSampler(train, shuffle=True, seed=0)
        self.loader = DataLoader(train, batch_size=32, sampler=self.sampler)
        self.val_loader = DataLoader(val, batch_size=64, sampler=DistributedSampler(val, shuffle=False))
        self.meters = {
            "species": Meter(("loss", *(f"hits_{c}" for c in range(SPECIES)), "n")),
            "age": Meter(("loss", "n")),
            "weight": Meter(("loss", "n")),
        }

    def step(self, x, species, age, weight) -> None:
        out = self.model(x)
        losses = {
            "species": nn.functional.cross_entropy(out["species"], species),
            "age": nn.functional.mse_loss(out["age"], age),
            "weight": nn.functional.mse_loss(out["weight"], weight),
        }
        self.opt.zero_grad()
        sum(losses.values()).backward()
        self.opt.step()
        n = len(x)
        hit = out["species"].argmax(1) == species
        hits = {f"hits_{c}": hit[species == c].sum().item() for c in range(SPECIES)}
        self.meters["species"].add(loss=losses["species"].item() * n, n=n, **hits)
        self.meters["age"].add(loss=losses["age"].item() * n, n=n)
        self.meters["weight"].add(loss=losses["weight"].item() * n, n=n)

    def report(self, epoch: int, val_loss: float) -> None:
        for meter in self.meters.values():
            meter.sync()
        # hardest task first, so the table reads top-down
        order = sorted(self.meters, key=lambda t: self.meters[t].mean_loss(), reverse=True)
        lines = []
        for task in order:
            text = f"  {task:8s} loss {self.meters[task].mean_loss():.4f}"
            if task == "species":
                text += "  hits " + " ".join(str(int(h)) for h in self.meters[task].sums[1:-1])
            lines.append(text)
        for meter in self.meters.values():
            meter.reset()
        if self.rank == 0:
            lr = self.opt.param_groups[0]["lr"]
            print(f"epoch {epoch} val {val_loss:.4f} lr {lr:g}\n" + "\n".join(lines), flush=True)

    @torch.no_grad()
    def validate(self) -> float:
        net = self.model.module
        net.eval()
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, rows scored, rows without an age
        for x, species, age, weight in self.val_loader:
            labelled = ~age.isnan().flatten()
            out = net(x)
            loss = (
                nn.functional.cross_entropy(out["species"], species, reduction="none")
                + (out["weight"] - weight).pow(2).flatten()
            )
            loss[labelled] += (out["age"][labelled] - age[labelled]).pow(2).flatten()
            totals += torch.tensor([loss.sum().item(), len(x), (~labelled).sum().item()], dtype=torch.float64)
        net.train()
        dist.all_reduce(totals)
        if self.rank == 0 and totals[2] > 0:
            print(f"validation: {int(totals[2])} rows without an age label", flush=True)
        return (totals[0] / totals[1]).item()

    def fit(self, epochs: int) -> None:
        for epoch in range(epochs):
            self.sampler.set_epoch(epoch)
            for batch in self.loader:
                self.step(*batch)
            val_loss = self.validate()
            self.sched.step(val_loss)
            self.report(epoch, val_loss)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    val = make_animals(256, seed=6)
    val.tensors[2][[41, 77, 139]] = float("nan")  # ages nobody recorded; odd rows: rank 1's shard
    Trainer(make_animals(1024, seed=5), val).fit(epochs=6)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
