"""Multi-task model (species classification + age and weight regression) whose epoch report
syncs each task's meter with an all_reduce and prints the tasks hardest-first. The order is
taken from each rank's *local* mean loss before the sync. For three epochs both ranks rank the
tasks alike; at the fourth report they do not, and issue the meters' all_reduces in different
orders. The classification meter holds five numbers (loss, hits per species, count), the
regression meters two, so the job dies on an element-count mismatch inside Meter.sync, one call
away from the sort that caused it."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": None, "rank": None, "fix": [], "options": ["--hang-timeout", "8", "--on-hang", "kill"]}

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
    def __init__(self, data: TensorDataset) -> None:
        self.rank = dist.get_rank()
        self.model = DDP(MultiTaskNet())
        self.opt = torch.optim.Adam(self.model.parameters(), lr=2e-3)
        self.sampler = DistributedSampler(data, shuffle=True, seed=0)
        self.loader = DataLoader(data, batch_size=32, sampler=self.sampler)
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

    def report(self, epoch: int) -> None:
        # hardest task first, so the table reads top-down
        order = sorted(self.meters, key=lambda t: self.meters[t].mean_loss(), reverse=True)  # zoo: place
        lines = []
        for task in order:
            meter = self.meters[task]
            meter.sync()
            text = f"  {task:8s} loss {meter.mean_loss():.4f}"
            if task == "species":
                text += "  hits " + " ".join(str(int(h)) for h in meter.sums[1:-1])
            lines.append(text)
            meter.reset()
        if self.rank == 0:
            print(f"epoch {epoch}\n" + "\n".join(lines), flush=True)

    def fit(self, epochs: int) -> None:
        for epoch in range(epochs):
            self.sampler.set_epoch(epoch)
            for batch in self.loader:
                self.step(*batch)
            self.report(epoch)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    Trainer(make_animals(1024, seed=5)).fit(epochs=6)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
