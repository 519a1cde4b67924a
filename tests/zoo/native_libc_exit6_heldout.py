"""A 'native augmentation library' (simulated here with ctypes) validates each batch in C and,
on a malformed input, calls the C library's exit(6) -- as some C libraries do. That is a
process exit from native code: no Python exception, no traceback, no SystemExit, and Python's
own atexit handlers never run. Only rank 1's shard contains the malformed batch (step 9), so
rank 1 vanishes with exit status 6 while rank 0 waits in the gradient all-reduce.
The root is rank 1 (exit status 6)."""

import ctypes

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {"kind": None, "rank": 1, "fix": ["exit", "native", "library"], "names": [["code 6", "status 6"]], "options": []}

_libc = ctypes.CDLL(None)


def native_augment(x: torch.Tensor) -> torch.Tensor:
    """Stand-in for the C extension: it 'checks' the batch and exits the process on bad input."""
    if x.abs().max() > 1e3:
        _libc.exit(6)
    return x + 0.01 * torch.randn_like(x)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(320, 16)
    y = torch.randint(0, 4, (320,))
    per = len(x) // 2
    shard_x, shard_y = x[rank * per:(rank + 1) * per].clone(), y[rank * per:(rank + 1) * per]
    if rank == 1:
        shard_x[9 * 8 + 3] *= 1e6   # a sensor glitch in rank 1's pre-sharded file
    loader = DataLoader(TensorDataset(shard_x, shard_y), batch_size=8, shuffle=False)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (xb, yb) in enumerate(loader):
        xb = native_augment(xb)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
