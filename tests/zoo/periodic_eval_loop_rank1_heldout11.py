"""Every 5th step rank 1 runs a small evaluation: 4 batches of a separate validation
DataLoader (num_workers=0) through model.module under torch.no_grad(), between
optimizer.step() and the next forward. Only rank 1 evaluates, so rank 0 waits for it at the
next gradient all-reduce."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "periodic_rank_work", "rank": 1,
          "fix": ["background", "less often", "asynchronous", "every rank"], "options": []}

STEPS = 50
PERIOD = 5


def evaluate(model: nn.Module, val_loader: DataLoader, batches: int = 4) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for i, (x, y) in enumerate(val_loader):
            if i == batches:
                break
            pred = model(x).argmax(dim=1)
            correct += (pred == y).sum().item()
            total += y.numel()
    model.train()
    return correct / max(total, 1)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * 16, 64), torch.randint(0, 10, (STEPS * 16,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    val = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    val_loader = DataLoader(val, batch_size=512, shuffle=False, num_workers=0)
    model = DDP(nn.Sequential(nn.Linear(64, 768), nn.ReLU(), nn.Linear(768, 768), nn.ReLU(),
                              nn.Linear(768, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    acc = 0.0
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 1 and step % PERIOD == PERIOD - 1:
            acc = evaluate(model.module, val_loader)  # zoo: place
    if rank == 1:
        print(f"final loss {loss.item():.3f}, val acc {acc:.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
