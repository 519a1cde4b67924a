"""Healthy twin of new_group_rank0_only: every rank creates the metrics group with
dist.new_group([0, 1]) (a collective of the default group) and sums its loss on it each epoch;
only rank 0 prints. Nothing is wrong."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    metrics_group = dist.new_group([0, 1])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        total = torch.zeros(1)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += loss.detach()
        dist.all_reduce(total, group=metrics_group)
        if rank == 0:
            print(f"epoch {epoch}: {total.item() / (2 * len(loader)):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
