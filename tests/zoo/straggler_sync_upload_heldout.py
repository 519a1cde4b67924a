"""Rank 0 uploads a checkpoint synchronously every step -> rank 0 is a straggler.

Story: a `CheckpointManager` saves on rank 0 only (correct: no collective inside) and
"uploads" the serialized state to object storage with a blocking PUT.  The run config
was copied from a debugging session and has `save_every_n_steps: 1`, so every step
rank 0 serializes the model and optimizer state and blocks ~50-60 ms on the network (two PUTs) (here
simulated by a latency model of the PUT).  Rank 1 finishes its step quickly and then sits
in DDP's gradient all-reduce of the next step, waiting for rank 0.  No error, the job is
just slow.

Root cause: rank 0 (straggler: time spent outside forward/backward, in the checkpoint
upload between optimizer.step and the next forward).
Right diagnosis: rank 0 is slow every step; rank 1 waits in the all-reduce; the extra
time is in rank 0's host-side code (checkpoint save/upload), not in compute.
Fix: checkpoint far less often (every N steps / time-based) and/or upload
asynchronously in a background thread after copying the state.
"""

import io
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": None,
    "rank": 0,
    "fix": [
        "async",
        "background",
        "thread",
        "less often",
        "less frequent",
        "every n",
        "save_every",
        "frequency",
        "interval",
        "checkpoint",
    ],
    "options": [],
}

CONFIG = {
    "ckpt": {"save_every_n_steps": 1, "bucket": "s3://team-ckpts/run-17"},
    "optim": {"lr": 1e-3},
    "steps": 60,
}


class ObjectStore:
    """Tiny stand-in for a blocking object-store client."""

    def __init__(self, bucket, latency_s=0.015, mbps=80.0):
        self.bucket = bucket
        self.latency_s = latency_s
        self.mbps = mbps
        self.objects = {}

    def put(self, key, payload: bytes):
        time.sleep(self.latency_s + len(payload) / (self.mbps * 1e6))
        self.objects[key] = len(payload)


class CheckpointManager:
    def __init__(self, cfg, rank):
        self.every = cfg["save_every_n_steps"]
        self.rank = rank
        self.store = ObjectStore(cfg["bucket"])

    def maybe_save(self, step, model, opt):
        if step % self.every != 0 or self.rank != 0:
            return
        buf = io.BytesIO()
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, buf)
        self.store.put(f"step-{step:06d}.pt", buf.getvalue())
        self.store.put("latest.pt", buf.getvalue())


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG["optim"]["lr"])
    ckpt = CheckpointManager(CONFIG["ckpt"], rank)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, CONFIG["steps"] + 1):
        x = torch.randn(32, 64, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.maybe_save(step, model, opt)
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
