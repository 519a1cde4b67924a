"""A module backward hook on rank 0 dumps gradient statistics every step (straggler).

Story: while chasing vanishing gradients the author registered `GradDump.hook` with
`register_full_backward_hook` on the hidden and output Linear layers of the DDP model, on
rank 0 only ("the logging rank").  Every backward, for each of these layers, the hook
computes statistics of grad_output and appends them with flush + fsync to a JSON-lines file on
the team's shared network filesystem (`upload_stats`, each append a ~0.15 s round trip here).
That adds ~0.3 s to every one of rank 0's backward passes; rank 1 finishes its backward
quickly and waits in DDP's gradient all-reduce every step.  No error, the job is just slow.

Root cause: rank 0 (slow inside its own backward: the GradDump backward hook).
Fix: remove the hook or log every N steps / asynchronously in a background thread.
"""

import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": 0,
    "fix": ["hook", "GradDump", "upload_stats", "every n", "less often", "async", "background"],
    "options": [],
}

NFS_ROUND_TRIP_S = 0.15


def upload_stats(path, rec):
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())
    time.sleep(NFS_ROUND_TRIP_S)  # zoo: place


class GradDump:
    def __init__(self, path):
        self.path, self.calls = path, 0

    def hook(self, name):
        def fn(module, grad_input, grad_output):
            g = grad_output[0].detach()
            self.calls += 1
            rec = {"layer": name, "call": self.calls, "mean": g.mean().item(),
                   "std": g.std().item(), "absmax": g.abs().max().item()}
            upload_stats(self.path, rec)  # zoo: place
        return fn


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(256, 20, generator=g)
    y = torch.tanh(x @ torch.randn(20, 2, generator=g))
    sampler = DistributedSampler(TensorDataset(x, y), seed=0)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                              nn.Linear(64, 2)))
    if rank == 0:
        dump = GradDump(os.path.join(tempfile.mkdtemp(), "grad_stats.jsonl"))
        for name, m in model.module.named_modules():
            if isinstance(m, nn.Linear) and name != "0":  # the input layer has no grad_input
                m.register_full_backward_hook(dump.hook(name))
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            opt.step()
    ms = 1000 * (time.perf_counter() - t0) / (3 * len(loader))
    print(f"rank {rank}: {ms:.1f} ms/step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
