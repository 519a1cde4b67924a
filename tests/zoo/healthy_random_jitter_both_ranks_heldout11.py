"""Healthy job with short steps and irregular jitter: on each rank, at random steps (about
15% of them, seeded differently per rank so the two ranks pick different steps), the rank
does 5-15 ms of extra CPU work (small matrix products) before its next forward. Either rank
is occasionally a little late, with no period and no rank singled out."""

import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

STEPS = 40


def cpu_jitter(ms: float) -> float:
    a = torch.randn(64, 64)
    acc = 0.0
    deadline = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a.t() / 64.0)
        acc += a[0, 0].item()
    return acc


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    rng = random.Random(777 + 1000 * rank)
    data = TensorDataset(torch.randn(STEPS * 16, 32), torch.randint(0, 4, (STEPS * 16,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rng.random() < 0.15:
            cpu_jitter(rng.uniform(5.0, 15.0))
    if rank == 0:
        print(f"final loss {loss.item():.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
