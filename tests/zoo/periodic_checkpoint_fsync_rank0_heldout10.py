"""Every 4th step rank 0 writes a checkpoint (model + Adam state, about 25 MB) with
torch.save to a temporary file, flushes and fsyncs it, then deletes it; rank 1 waits for it at
the next gradient all-reduce. About 40 steps."""

import os
import tempfile

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


def save_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, step: int, folder: str) -> None:
    fd, path = tempfile.mkstemp(prefix=f"ckpt_{step}_", suffix=".pt", dir=folder)
    with os.fdopen(fd, "wb") as f:
        torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.remove(path)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(640, 64), torch.randint(0, 8, (640,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(
        nn.Sequential(
            nn.Linear(64, 1024),
            nn.ReLU(),
            nn.Linear(1024, 1024),
            nn.ReLU(),
            nn.Linear(1024, 1024),
            nn.ReLU(),
            nn.Linear(1024, 8),
        )
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    folder = tempfile.mkdtemp(prefix="ddp_ckpt_") if rank == 0 else ""
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % 4 == 3:
            save_checkpoint(model.module, opt, step, folder)  # zoo: place
    if rank == 0:
        os.rmdir(folder)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
