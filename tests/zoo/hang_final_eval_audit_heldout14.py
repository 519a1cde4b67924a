"""Intent classifier; after training, every rank evaluates its shard of the held-out set and
rank 0 saves the model behind a barrier. Rank 1's shard holds one row whose label was never
filled in (-1). Only on a batch with such rows does the evaluator call a helper that all-reduces
a count for the log, so rank 1 alone issues that all_reduce. It has the same signature as the
evaluation totals' all_reduce, which rank 0 issues next, so the two silently pair up (rank 0
prints a wrong accuracy); at the next collective rank 0 waits in the barrier before saving while
rank 1 waits in its totals all_reduce: a hang at two lines, neither of them the cause."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": [],
    "options": ["--hang-timeout", "8", "--on-hang", "kill"],
    "names": ["_log_unlabeled"],
    "never": ["skipped the barrier"],
}

FEATURES, INTENTS = 20, 5


def make_split(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(INTENTS, FEATURES, generator=g) * 2
    y = torch.randint(0, INTENTS, (n,), generator=g)
    x = centers[y] + torch.randn(n, FEATURES, generator=g)
    return TensorDataset(x, y)


class IntentNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.classifier = nn.Linear(64, INTENTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x))


class Evaluator:
    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.rank = dist.get_rank()

    def _log_unlabeled(self, labelled: torch.Tensor) -> None:
        counts = torch.tensor([(~labelled).sum().item(), labelled.numel()], dtype=torch.float64)
        dist.all_reduce(counts)  # zoo: place
        if self.rank == 0:
            print(f"eval: skipping {int(counts[0])} of {int(counts[1])} rows without a label", flush=True)

    @torch.no_grad()
    def run(self, model: nn.Module) -> float:
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        for x, y in self.loader:
            labelled = y >= 0
            if not labelled.all():
                self._log_unlabeled(labelled)
                x, y = x[labelled], y[labelled]
            pred = model(x).argmax(1)
            totals += torch.tensor([(pred == y).sum().item(), len(y)], dtype=torch.float64)
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    train = make_split(640, seed=1)
    test = make_split(200, seed=1)
    test.tensors[1][137] = -1  # an annotator skipped this row; odd index: rank 1's shard
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=32, sampler=sampler)
    evaluator = Evaluator(DataLoader(test, batch_size=25, sampler=DistributedSampler(test, shuffle=False)))

    model = DDP(IntentNet())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    acc = evaluator.run(model.module)
    if rank == 0:
        print(f"test accuracy {acc:.3f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/intent_net.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
