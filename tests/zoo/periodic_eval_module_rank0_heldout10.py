"""Every 6th step rank 0 alone evaluates 3 held-out batches of 16 images under torch.no_grad()
through the underlying module (model.module); the small CNN is cheap to all-reduce but costly to
run, so each evaluation takes roughly 80-150 ms. Rank 1 waits for it at the next gradient
all-reduce. 48 steps in total."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": "periodic_rank_work",
    "rank": 0,
    "fix": ["background", "less often", "asynchronous", "every rank"],
    "options": [],
}


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def evaluate(net: nn.Module, batches) -> float:
    net.eval()
    correct = 0
    with torch.no_grad():
        for x, y in batches:
            correct += int((net(x).argmax(1) == y).sum())
    net.train()
    return correct / sum(len(y) for _, y in batches)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(768, 3, 32, 32), torch.randint(0, 10, (768,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    val = [(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))) for _ in range(3)]
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % 6 == 5:
            evaluate(model.module, val)  # zoo: place
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
