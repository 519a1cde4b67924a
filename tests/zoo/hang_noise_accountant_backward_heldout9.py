"""A custom autograd Function's backward blocks on rank 1 (hang inside backward).

Story: a DP-style trainer adds Gaussian noise to the hidden activations' gradients through a
custom `torch.autograd.Function` (`NoisyGrad`: identity forward, `grad + sigma * noise`
backward).  Sigma comes from a privacy "accountant" that publishes one value per step into a
`queue.Queue`; `NoisyGrad.backward` takes the next one with a blocking `SIGMAS.get()`.  The
queue is pre-filled with WARMUP sigmas on every rank, but the accountant thread that keeps it
fed is started under `if rank == 0:` ("the accountant is global state, one copy is enough"),
and a Queue is per process.  After the warmup steps rank 1's backward waits forever in
`SIGMAS.get()`; rank 0 finishes its backward and waits in DDP's gradient all-reduce.

Root cause: rank 1 (blocked in its own backward, in NoisyGrad.backward).
Fix: feed sigma on every rank (start the accountant everywhere / compute sigma locally, or
broadcast it), and never block without a timeout inside backward.
"""

import queue
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["NoisyGrad", "backward", "accountant", "sigma", "queue", "every rank"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

WARMUP = 10
SIGMAS: "queue.Queue[float]" = queue.Queue()


class NoisyGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        sigma = SIGMAS.get()  # zoo: place
        return grad + sigma * torch.randn_like(grad)


def accountant(steps: int) -> None:
    for step in range(steps):
        SIGMAS.put(0.01 / (1 + 0.01 * step))
        time.sleep(0.001)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(24, 64), nn.Tanh())
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        return self.head(NoisyGrad.apply(self.enc(x)))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    for _ in range(WARMUP):
        SIGMAS.put(0.01)
    if rank == 0:
        threading.Thread(target=accountant, args=(10_000,), daemon=True).start()
    x = torch.randn(768, 24, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long())
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = DDP(Net())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
