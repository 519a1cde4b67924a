"""HEALTHY: rank 0 writes a checkpoint, then every rank meets at a barrier.

Every 2 epochs `Checkpointer.maybe_save()` runs on all ranks: rank 0
serialises model + optimizer + scheduler state to a temp file and renames it
atomically, then *all* ranks call `dist.barrier()`; rank 1 afterwards loads
the checkpoint back to verify it can be read (a common "resume smoke test").
Rank-0-only work followed by a barrier looks suspicious but is correct: every
rank issues the same collectives in the same order, and the rank-0 block
takes a few ms only.  StepLR scheduler, gradient clipping, DistributedSampler
with set_epoch.  Exits 0.

Expected: no warning, no error.
"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = None


class Checkpointer:
    def __init__(self, directory, every):
        self.directory = directory
        self.every = every
        self.path = os.path.join(directory, "last.pt")

    def maybe_save(self, epoch, model, opt, sched):
        if (epoch + 1) % self.every:
            return
        if dist.get_rank() == 0:
            tmp = self.path + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, self.path)
        dist.barrier()
        if dist.get_rank() == 1:
            state = torch.load(self.path, map_location="cpu")
            assert state["epoch"] == epoch


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # shared directory agreed on by broadcasting rank 0's choice
    holder = [tempfile.mkdtemp(prefix="ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    ckpt = Checkpointer(holder[0], every=2)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(768, 10, generator=g)
    y = x @ torch.randn(10, 1, generator=g) + 0.1
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, world, rank, shuffle=True)
    loader = DataLoader(ds, batch_size=32, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for epoch in range(6):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
            opt.step()
        sched.step()
        ckpt.maybe_save(epoch, model, opt, sched)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
