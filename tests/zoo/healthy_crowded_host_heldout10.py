"""Healthy job on a crowded host: before training, rank 0's side starts a daemon background
*process* (multiprocessing) that burns CPU in irregular bursts (random 5-30 ms of busy work,
random 5-40 ms gaps) for the whole run, as another tenant of the machine would. Both ranks train
the same small MLP identically for 40 steps; nobody does rank-only work in the training loop."""

import multiprocessing as mp
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


def noisy_neighbour(seed: int, started) -> None:
    rng = random.Random(seed)
    started.set()
    while True:
        end = time.perf_counter() + rng.uniform(0.005, 0.030)
        x = 0
        while time.perf_counter() < end:
            x = (x * 1103515245 + 12345) % 2147483648
        time.sleep(rng.uniform(0.005, 0.040))


def main() -> None:
    burner = None
    if os.environ.get("RANK", "0") == "0":
        # forked before the process group exists, so no gloo threads are duplicated
        ctx = mp.get_context("fork")
        started = ctx.Event()
        burner = ctx.Process(target=noisy_neighbour, args=(1234, started), daemon=True)
        burner.start()
        started.wait(timeout=10)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(640, 32), torch.randint(0, 4, (640,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    dist.barrier()
    if burner is not None:
        burner.terminate()
        burner.join()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
