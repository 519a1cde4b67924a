"""Autograd anomaly detection left switched on for one rank (straggler).

Story: a week ago the loss went NaN on rank 1's shard, and to find the op the author added a
debug switch, `DEBUG["detect_anomaly_ranks"] = [1]`, which calls
`torch.autograd.set_detect_anomaly(True)` on the listed ranks only ("don't slow down the
whole job").  The NaN was fixed, the switch stayed.  Anomaly mode records a Python stack
trace for every op in the forward and checks every gradient in the backward, so on this
deep residual MLP with many small ops rank 1's forward and backward are much slower; rank 0
arrives first at every gradient all-reduce and waits.  No error, the job is just slow.

Root cause: rank 1 (extra per-op work in forward and backward from anomaly detection).
Right diagnosis: straggler: rank 1 is the last at the gradient sync on nearly every step,
the time being in its forward/backward.
Fix: turn anomaly detection off (it is a debugging tool); in general, remove the extra
work from rank 1's forward/backward.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["anomaly", "forward", "backward"],
    "options": [],
}

DEBUG = {"detect_anomaly_ranks": [1]}


class ResBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)))) * 0.5


class DeepMLP(nn.Module):
    def __init__(self, dim=32, depth=12):
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.blocks = nn.ModuleList(ResBlock(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank in DEBUG["detect_anomaly_ranks"]:
        torch.autograd.set_detect_anomaly(True)
    torch.manual_seed(0)
    model = DDP(DeepMLP())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4800, 16, generator=g)
    y = torch.randint(0, 3, (4800,), generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    for epoch in range(1):
        sampler.set_epoch(epoch)
        for step, (xb, yb) in enumerate(loader):
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 50 == 0:
                print(f"step {step} loss {loss.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
