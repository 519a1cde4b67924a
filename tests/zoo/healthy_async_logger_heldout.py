"""HEALTHY: rank 0 logs through a background writer thread; checkpoints are barrier-fenced.

Story: a small convnet trainer.  Only rank 0 owns a `AsyncScalarWriter` (a TensorBoard-
like event writer): the training loop just puts (tag, value, step) into a queue and a
daemon thread serialises the records and flushes/fsyncs them to disk, with a slow
"flush" every few records -- none of this blocks the training loop and it contains no
collective.  Every 20 steps rank 0 writes a checkpoint inside `if rank == 0:` and then
*all* ranks meet in `dist.barrier()` (outside the if), which is the correct pattern.
Rank-dependent code paths, but no rank-dependent collectives and no slow rank.
Exits 0.
"""

import json
import os
import queue
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None


class AsyncScalarWriter:
    def __init__(self, logdir, flush_every=10):
        self.path = os.path.join(logdir, "events.jsonl")
        self.q = queue.Queue()
        self.flush_every = flush_every
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def add_scalar(self, tag, value, step):
        self.q.put((tag, float(value), step, time.time()))

    def _run(self):
        with open(self.path, "a") as f:
            n = 0
            while True:
                item = self.q.get()
                if item is None:
                    break
                tag, value, step, wall = item
                f.write(json.dumps({"tag": tag, "value": value, "step": step, "wall": wall}) + "\n")
                n += 1
                if n % self.flush_every == 0:
                    f.flush()
                    os.fsync(f.fileno())
                    time.sleep(0.05)  # slow network filesystem

    def close(self):
        self.q.put(None)
        self.thread.join()


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.body(x))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    logdir = tempfile.mkdtemp(prefix="tb-")
    writer = AsyncScalarWriter(logdir) if rank == 0 else None
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 61):
        x = torch.randn(16, 3, 16, 16, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if writer is not None:
            writer.add_scalar("train/loss", loss.item(), step)
            writer.add_scalar("train/lr", opt.param_groups[0]["lr"], step)
        if step % 20 == 0:
            if rank == 0:
                torch.save(
                    {"model": model.module.state_dict(), "step": step}, os.path.join(logdir, "last.pt")
                )
            dist.barrier()
    if writer is not None:
        writer.close()
        with open(writer.path) as fh:
            print("logged", sum(1 for _ in fh), "records", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
