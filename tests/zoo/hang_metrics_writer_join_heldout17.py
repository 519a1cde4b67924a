"""One rank blocks forever in its own metrics writer's queue.join() -> the other waits in the all-reduce.

Story: an image-patch classifier logs per-step metrics through a small background writer
(a thread that turns each record into a strict-JSON line for the dashboard).  Every 10 steps
the training loop calls `writer.flush()`, which waits on `queue.join()` so the file is complete
before the step counter moves on.  Rank 1's node holds a shard without any class-3 patches, so
its running per-class recall holds a NaN (0/0) for class 3; `json.dumps(..., allow_nan=False)`
raises inside the writer thread, the thread dies without `task_done()`, and rank 1's first
flush never returns.  It sits idle in `queue.join()` while rank 0 waits for it in the next
step's gradient all-reduce.

Root cause: rank 1, blocked in its own code (MetricsWriter.flush -> queue.join), not in a
collective.
Fix: don't block the training loop on the writer thread (a join with a timeout / check the
thread is alive, call task_done in a finally, sanitize NaN before logging).
"""

import json
import os
import queue
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": ["hang", "awaited_work"],
    "rank": 1,
    "fix": ["flush", "join", "queue", "thread", "writer", "MetricsWriter"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

CLASSES = 4


class MetricsWriter:
    def __init__(self, path):
        self.q = queue.Queue()
        self.f = open(path, "w")  # noqa: SIM115 (open for the writer thread's life)
        self.thread = threading.Thread(target=self._run, name="metrics-writer", daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            rec = self.q.get()
            self.f.write(json.dumps(rec, allow_nan=False) + "\n")  # the dashboard wants strict JSON
            self.q.task_done()

    def log(self, **rec):
        self.q.put(rec)

    def flush(self):
        self.q.join()  # zoo: place
        self.f.flush()


def load_patches(rank, n=1024):
    """Stand-in for this node's patch shard; node 1's scanner never produced class 3."""
    g = torch.Generator().manual_seed(900 + rank)
    y = torch.randint(0, CLASSES if rank == 0 else CLASSES - 1, (n,), generator=g)
    x = torch.randn(n, 1, 12, 12, generator=g)
    for c in range(CLASSES):
        x[y == c, 0, (c // 2) * 6 : (c // 2) * 6 + 6, (c % 2) * 6 : (c % 2) * 6 + 6] += 1.0
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(8 * 6 * 6, CLASSES)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(load_patches(rank), batch_size=32, shuffle=True)
    log_dir = tempfile.mkdtemp(prefix="patchcls-")
    writer = MetricsWriter(os.path.join(log_dir, f"metrics-rank{rank}.jsonl"))

    step = 0
    for epoch in range(2):
        hits = torch.zeros(CLASSES)
        seen = torch.zeros(CLASSES)
        for x, y in loader:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            pred = logits.argmax(1)
            seen += torch.bincount(y, minlength=CLASSES)
            hits += torch.bincount(y[pred == y], minlength=CLASSES)
            writer.log(step=step, loss=loss.item(), recall=(hits / seen).tolist())
            step += 1
            if step % 10 == 0:
                writer.flush()  # zoo: place
                if rank == 0:
                    print(f"epoch {epoch} step {step}: loss {loss.item():.4f}", flush=True)
    writer.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
