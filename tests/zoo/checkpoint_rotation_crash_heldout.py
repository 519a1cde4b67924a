"""Rank 0 writes a checkpoint every `save_every` steps and rotates old ones
(`CheckpointRing.push`). The rotation has an off-by-one: at the second save (step 20) it tries
to delete the checkpoint of step 0, which was never written, and `os.remove` raises
FileNotFoundError. Nothing catches it, so rank 0 dies mid-training; rank 1 is already in the
gradient all-reduce of step 21 and fails there with a gloo "Connection closed by peer" /
"Connection reset" error.

A right diagnosis: root rank 0, dead first with FileNotFoundError at the marked `os.remove` in
`CheckpointRing.push`; rank 1's connection error is the consequence. Fix: guard the removal
(check the file exists / `missing_ok`, or only delete checkpoints that were written)."""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": 0,
    "fix": ["exist", "missing", "filenotfound", "os.remove", "remove", "guard", "checkpoint"],
    "names": ["FileNotFoundError"],
    "options": [],
}

RUN = {
    "n": 256,
    "dim": 8,
    "classes": 2,
    "batch_size": 8,
    "epochs": 2,
    "lr": 0.1,
    "save_every": 10,
    "keep_last": 2,
    "seed": 5,
}


class CheckpointRing:
    def __init__(self, root, every, keep):
        self.root = root
        self.every = every
        self.keep = keep

    def path(self, step):
        return os.path.join(self.root, f"step-{step:05d}.pt")

    def push(self, step, module):
        torch.save(module.state_dict(), self.path(step))
        stale = step - self.keep * self.every
        if stale >= 0:
            os.remove(self.path(stale))  # zoo: place


def toy_problem(cfg):
    g = torch.Generator().manual_seed(cfg["seed"])
    x = torch.randn(cfg["n"], cfg["dim"], generator=g)
    y = (x.sum(1) > 0).long()
    return TensorDataset(x, y)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = RUN
    ds = toy_problem(cfg)
    sampler = DistributedSampler(ds, seed=cfg["seed"])
    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler)
    torch.manual_seed(cfg["seed"])
    model = DDP(nn.Sequential(nn.Linear(cfg["dim"], 32), nn.ReLU(), nn.Linear(32, cfg["classes"])))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    ring = None
    if rank == 0:
        ckpt_dir = tempfile.mkdtemp(prefix="zoo_ring_")
        ring = CheckpointRing(ckpt_dir, cfg["save_every"], cfg["keep_last"])
    step = 0
    try:
        for epoch in range(cfg["epochs"]):
            sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                step += 1
                if ring is not None and step % cfg["save_every"] == 0:
                    ring.push(step, model.module)
                    print(f"step {step} loss {loss.item():.4f} (saved)", flush=True)
    finally:
        if ring is not None:
            shutil.rmtree(ring.root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
