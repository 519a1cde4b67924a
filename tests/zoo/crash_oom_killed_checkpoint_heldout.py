"""Rank 0 is SIGKILLed (host OOM killer) while consolidating a checkpoint (crash).

At the end of every epoch rank 0 runs `CheckpointManager.save()`, which first
builds a "consolidated" copy of the state: it deep-copies the model, the
optimizer state and a rolling history of the last K checkpoints kept in host
memory (`self.history`), and only then writes the file.  The history grows
every epoch; at epoch 2 the host runs out of memory and the kernel OOM killer
SIGKILLs rank 0 (emulated here with os.kill(os.getpid(), SIGKILL) once the
estimated resident size passes the host limit -- that stands in for the
kernel, the user's code does not do it itself).  No Python traceback is
printed for rank 0; rank 1, waiting in the barrier after the checkpoint, then
fails with a connection error.

Root cause: rank 0 (killed by SIGKILL / out of host memory during checkpointing).
Right diagnosis: rank 0 died from a signal (SIGKILL, likely OOM) inside the
checkpoint routine; rank 1's error is a consequence.
Fix: don't keep checkpoint history in host memory (write to disk, stream the
state dict), reduce host memory use of the checkpoint routine.
"""
import copy
import os
import signal
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": None,
    "rank": 0,
    "fix": ["memory", "oom", "sigkill", "dmesg", "checkpoint"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

HOST_LIMIT_BYTES = 3_000_000   # the (tiny, emulated) host memory budget


def _emulated_kernel_oom_check(nbytes):
    # Stands in for the kernel: a process over the cgroup limit gets SIGKILL.
    if nbytes > HOST_LIMIT_BYTES:
        os.kill(os.getpid(), signal.SIGKILL)


class CheckpointManager:
    def __init__(self, directory, keep=8):
        self.directory = directory
        self.keep = keep
        self.history = []

    def save(self, model, opt, epoch):
        state = {
            "model": copy.deepcopy(model.module.state_dict()),
            "opt": copy.deepcopy(opt.state_dict()),
            "epoch": epoch,
        }
        self.history.append(state)
        self.history = self.history[-self.keep:]
        consolidated = {"latest": state, "history": copy.deepcopy(self.history)}
        resident = sum(
            t.numel() * t.element_size()
            for s in self.history
            for t in list(s["model"].values())
            for _ in range(len(self.history))
        )
        _emulated_kernel_oom_check(resident)
        torch.save(consolidated, os.path.join(self.directory, "ckpt.pt"))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256),
                              nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = CheckpointManager(tempfile.mkdtemp(prefix="ckpt_"))
    g = torch.Generator().manual_seed(rank)
    for epoch in range(5):
        for _step in range(20):
            x = torch.randn(32, 64, generator=g)
            y = torch.randint(0, 10, (32,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if rank == 0:
            ckpt.save(model, opt, epoch)
            print(f"epoch {epoch} checkpoint saved", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
