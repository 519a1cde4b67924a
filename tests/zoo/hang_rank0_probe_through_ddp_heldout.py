"""Rank 0 runs a monitoring forward through the DDP wrapper, in train mode (hang).

Every 10 steps the main process computes the loss on a fixed "probe" batch
for its dashboard: `ProbeMonitor.log(model)`, called only on rank 0.  It
calls the DDP-wrapped model (not `model.module`), without `model.eval()` and
without `torch.no_grad()`.  The model has BatchNorm, so DDP's forward
broadcasts the buffers from rank 0 before running (broadcast_buffers=True):
rank 0's extra forward issues a broadcast that rank 1 never issues at that
point.  From then on the two ranks' collectives are out of step (rank 0's
probe broadcast pairs with rank 1's next training-forward broadcast, and so
on) and the job stalls / fails at the first probe.

Root cause: rank 0 (the extra forward through the DDP wrapper in
ProbeMonitor.log).
Right diagnosis: rank 0 makes an extra DDP forward (buffer broadcast) that
rank 1 does not make -> collective mismatch / hang, pointing at the probe
forward.
Fix: evaluate with `model.module` under `torch.no_grad()` / `model.eval()`
(or run the probe on every rank), don't call the DDP wrapper on one rank.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": None,
    "rank": 0,
    "fix": ["model.module", ".module", "no_grad", "eval", "every rank", "all ranks",
            "wrapper", "broadcast_buffers"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(),
                                  nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU())
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        return self.head(self.body(x))


class ProbeMonitor:
    def __init__(self):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(64, 16, generator=g)
        self.y = torch.randint(0, 3, (64,), generator=g)
        self.history = []

    def log(self, model, step):
        logits = model(self.x)  # zoo: place
        loss = nn.functional.cross_entropy(logits, self.y).item()
        self.history.append((step, loss))
        print(f"step {step} probe loss {loss:.4f}", flush=True)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = ProbeMonitor() if rank == 0 else None
    g = torch.Generator().manual_seed(rank)
    for step in range(60):
        x = torch.randn(32, 16, generator=g)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if monitor is not None and step % 10 == 9:
            monitor.log(model, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
