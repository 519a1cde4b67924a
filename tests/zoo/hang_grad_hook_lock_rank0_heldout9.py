"""A parameter gradient hook deadlocks on rank 0 (hang inside backward).

Story: to watch for exploding gradients, rank 0 (the "logging rank") registers
`GradNormLog.hook` with `param.register_hook` on every weight of the DDP model.  The hook
takes the logger's `threading.Lock`, appends the gradient norm to a buffer, and every
ROTATE_EVERY records rotates the log file by calling `self.write(...)` -- which takes the same
non-reentrant Lock again.  So at the first rotation rank 0 deadlocks inside its own hook in
the middle of backward; rank 1 finishes its backward and waits in DDP's gradient all-reduce.

Root cause: rank 0 (blocked in its own gradient hook, GradNormLog.write / hook).
Fix: do not re-acquire the lock in the hook (RLock, or write outside the lock), keep hooks
non-blocking.
"""

import os
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": 0,
    "fix": ["GradNormLog", "hook", "lock", "RLock", "reentrant", "deadlock"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

ROTATE_EVERY = 40


class GradNormLog:
    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()
        self.buf = []
        self.n = 0

    def write(self, text):
        with self.lock, open(self.path, "a") as f:  # zoo: place
            f.write(text)

    def hook(self, name):
        def fn(grad):
            with self.lock:
                self.buf.append(f"{name} {grad.norm().item():.5f}\n")
                self.n += 1
                if self.n % ROTATE_EVERY == 0:
                    self.write("".join(self.buf))  # zoo: place
                    self.buf.clear()
            return grad
        return fn


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(640, 16), torch.randint(0, 5, (640,)))
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(),
                              nn.Linear(48, 5)))
    if rank == 0:
        log = GradNormLog(os.path.join(tempfile.mkdtemp(), "gradnorm.log"))
        for name, p in model.module.named_parameters():
            if name.endswith("weight"):
                p.register_hook(log.hook(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(4):
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
