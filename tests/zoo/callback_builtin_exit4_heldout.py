"""A tiny trainer with step callbacks. One callback, a 'memory budget' watchdog someone copied
from a notebook, measures the size of the rank's cached batches and calls the builtin exit(4)
when it crosses a budget. Only rank 1 caches hard-example batches, so only rank 1 crosses the
budget (at step 14) and leaves with status 4 -- no traceback, just one line on stdout. Rank 0
goes on to the next step and waits in the gradient all-reduce. The root is rank 1 (status 4)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": None, "rank": 1, "fix": ["exit", "callback", "every rank"], "names": [["code 4", "status 4"]], "options": []}

BUDGET_BYTES = 40_000


class HardExampleCache:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.batches: list[torch.Tensor] = []

    def on_step_end(self, trainer: "Trainer", x: torch.Tensor, loss: torch.Tensor) -> None:
        if self.enabled:
            self.batches.append(x.clone())


class MemoryBudget:
    def __init__(self, cache: HardExampleCache) -> None:
        self.cache = cache

    def on_step_end(self, trainer: "Trainer", x: torch.Tensor, loss: torch.Tensor) -> None:
        used = sum(b.numel() * b.element_size() for b in self.cache.batches)
        if used > BUDGET_BYTES:
            print(f"memory budget exceeded at step {trainer.step}: {used} bytes > {BUDGET_BYTES}", flush=True)
            exit(4)  # zoo: place


class Trainer:
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, callbacks: list) -> None:
        self.model, self.opt, self.callbacks, self.step = model, opt, callbacks, 0

    def fit(self, loader: DataLoader, epochs: int) -> None:
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                self.opt.zero_grad()
                loss = nn.functional.cross_entropy(self.model(x), y)
                loss.backward()
                self.opt.step()
                self.step += 1
                for cb in self.callbacks:
                    cb.on_step_end(self, x, loss)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 48), torch.randint(0, 3, (256,)))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cache = HardExampleCache(enabled=(rank == 1))
    Trainer(model, opt, [cache, MemoryBudget(cache)]).fit(loader, epochs=3)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
