"""Healthy 3-epoch x 8-step job (24 steps, small MLP): at each epoch end EVERY rank evaluates
2 held-out batches of its own under torch.no_grad() and all-reduces the accuracy; rank 0 prints
it. Every rank does the same work at the same point, so nobody waits for anyone."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    g = torch.Generator().manual_seed(100 + rank)
    val = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(2)]
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            correct = sum(int((model.module(vx).argmax(1) == vy).sum()) for vx, vy in val)
        model.train()
        acc = torch.tensor([correct / 64.0])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch}: val acc {acc.item() / 2:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
