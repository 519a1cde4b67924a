"""A per-sample input guard left on for one rank only makes it a (short-step) straggler.

Story: a 32-64-64-8 MLP over tabular sensor features, batch 48, DistributedSampler +
set_epoch, 4 epochs of 12 steps (48 steps, ~1-2 ms each when healthy).  After a bad export
once fed NaNs and out-of-range readings into training, the author added `InputGuard` to the
model's `forward`: it walks the batch row by row in Python and checks every row for
non-finite values, out-of-range magnitudes, a dead (constant) sensor vector, mostly-zero
readings and repeated rows, raising on a bad row.  To "keep the cost off the hot path" it is
only enabled on one replica (`guard_rank = world_size - 1`, i.e. rank 1), which checks only
its own shard anyway.  The row-by-row checks cost rank 1 roughly 1-1.5 ms extra in every
forward; rank 0 reaches every gradient all-reduce first and
waits.  Nothing fails; every step is just as slow as rank 1's.

Root cause: rank 1 (extra work in its model forward: the per-row input guard).
Right diagnosis: straggler, rank 1, slow in forward on (nearly) every step; rank 0 waits in
the gradient all-reduce.
Fix: remove the guard from forward, or vectorize it (one `isfinite().all()` / `abs().amax()`
over the whole batch) and run it on every rank or offline on the data.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {"kind": "straggler", "rank": 1, "fix": ["forward", "guard", "vectoriz"], "options": []}


class InputGuard(nn.Module):
    def __init__(self, enabled, max_abs=40.0):
        super().__init__()
        self.enabled = enabled
        self.max_abs = max_abs

    def forward(self, x):
        if not self.enabled:
            return x
        prev = None
        for i, row in enumerate(x):  # zoo: place
            if not bool(torch.isfinite(row).all()):
                raise ValueError(f"non-finite input in row {i}")
            if float(row.abs().max()) > self.max_abs:
                raise ValueError(f"out-of-range input in row {i}")
            if float(row.std()) == 0.0:
                raise ValueError(f"dead sensor vector in row {i}")
            if int((row == 0).sum()) > row.numel() // 2:
                raise ValueError(f"more than half the sensors read 0 in row {i}")
            if prev is not None and torch.equal(row, prev):
                raise ValueError(f"row {i} repeats row {i - 1} (stuck exporter)")
            prev = row
        return x


class SensorNet(nn.Module):
    def __init__(self, guard):
        super().__init__()
        self.guard = InputGuard(guard)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                  nn.Linear(64, 8))

    def forward(self, x):
        return self.body(self.guard(x))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    guard_rank = world - 1
    g = torch.Generator().manual_seed(17)
    y = torch.randint(0, 8, (1152,), generator=g)
    x = torch.randn(8, 32, generator=g)[y] + 0.7 * torch.randn(1152, 32, generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=1)
    loader = DataLoader(data, batch_size=48, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(SensorNet(guard=rank == guard_rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for step, (xb, yb) in enumerate(loader):
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 6 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
