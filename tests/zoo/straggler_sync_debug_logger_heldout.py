"""The rank chosen as "debug logger" does heavy per-step work synchronously (straggler).

The config has `debug_log_rank: 1` (meant to keep rank 0's stdout clean).  On
that rank `DebugLogger.after_step()` runs every step: it computes per-tensor
weight/gradient statistics and 64-bin histograms for every parameter, formats
them into a JSON line and appends it to a file with flush + os.fsync --
synchronously in the training loop.  That costs rank 1 roughly 60 ms per
step; rank 0 then waits for rank 1 in the next step's gradient all_reduce.
No error, just a slow job.

Root cause: rank 1 (extra per-step host work after the optimizer step).
Right diagnosis: straggler, rank 1, slow outside forward/backward (host-side
logging between steps), rank 0 waiting in the all_reduce.
Fix: log less often (every N steps), make logging asynchronous/background,
drop the fsync, or do the heavy statistics only occasionally.
"""
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["logging", "logger", "async", "less often", "every n", "frequen", "fsync",
            "background", "histogram", "interval"],
    "options": [],
}

CONFIG = {"debug_log_rank": 1, "steps": 70, "batch": 32}


class DebugLogger:
    def __init__(self, path):
        self.f = open(path, "a")  # noqa: SIM115 - open for the logger's lifetime

    def _stats(self, t):
        flat = t.detach().flatten()
        hist = torch.histc(flat, bins=64).tolist()
        # per-bin relative frequencies and quantiles, computed in python
        total = sum(hist) or 1.0
        q = sorted(flat.tolist())
        return {
            "mean": sum(q) / len(q),
            "p01": q[int(0.01 * (len(q) - 1))],
            "p50": q[len(q) // 2],
            "p99": q[int(0.99 * (len(q) - 1))],
            "hist": [h / total for h in hist],
        }

    def after_step(self, step, model, loss):
        rec = {"step": step, "loss": loss}
        for name, p in model.named_parameters():
            rec[name] = {"w": self._stats(p), "g": self._stats(p.grad)}
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(),
                              nn.Linear(384, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    logger = None
    if rank == CONFIG["debug_log_rank"]:
        logger = DebugLogger(os.path.join(tempfile.mkdtemp(), "debug.jsonl"))
    g = torch.Generator().manual_seed(rank)
    for step in range(CONFIG["steps"]):
        x = torch.randn(CONFIG["batch"], 32, generator=g)
        y = torch.randint(0, 8, (CONFIG["batch"],), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if logger is not None:
            logger.after_step(step, model.module, loss.item())
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
