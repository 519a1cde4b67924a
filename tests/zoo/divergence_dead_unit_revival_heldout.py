"""A "dead ReLU revival" trick decides and re-draws on each rank's own batch (divergence).

Story: a tabular regression MLP suffers from dead ReLUs, so the author added a
`DeadUnitReviver`: every 10 steps it looks at the hidden activations of the CURRENT batch
(captured by a forward hook) and re-initializes, in place, the rows of `hidden.weight` /
`hidden.bias` of the units that never fired, with fresh random values.  The decision uses
each rank's own batch and the new values come from each rank's own RNG (seeded by rank for
the input noise), so after the first revival the ranks hold different `hidden` weights.
DDP all-reduces gradients, not weights, so nothing ever brings them back together; no
error, the job finishes and rank 0 saves its own version.

Root cause: rank-local parameter edits (no single root rank: each rank edits differently).
Right diagnosis: weights diverged: `hidden.weight`/`hidden.bias` differ between ranks from
step 10 on (a rank-dependent update after wrapping).
Fix: make the edit identical on every rank: decide on all-reduced activation counts and
draw the new rows with a shared seed (or on rank 0 and broadcast them).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["weights_diverged"],
    "rank": None,
    "fix": ["all_reduce", "allreduce", "all-reduce", "broadcast", "every rank", "all ranks",
            "agree", "shared", "global", "identical"],
    "names": ["hidden"],
    "options": [],
}


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 48)
        self.hidden = nn.Linear(48, 48)
        self.out = nn.Linear(48, 1)
        with torch.no_grad():
            self.hidden.bias[::3] = -1.5  # an old "sparsity" init that leaves many units dead

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = torch.relu(self.hidden(h))
        return self.out(h).squeeze(-1)


class DeadUnitReviver:
    def __init__(self, layer, every=10):
        self.layer = layer
        self.every = every
        self.last = None
        layer.register_forward_hook(self._capture)

    def _capture(self, module, inputs, output):
        self.last = output.detach()

    def maybe_revive(self, step):
        if step == 0 or step % self.every:
            return 0
        dead = (self.last <= 0).all(0)
        if dead.any():
            with torch.no_grad():
                fan_in = self.layer.weight.shape[1]
                self.layer.weight[dead] = torch.randn(int(dead.sum()), fan_in) / fan_in**0.5
                self.layer.bias[dead] = 0.01
        return int(dead.sum())


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Regressor()
    model = DDP(net)
    reviver = DeadUnitReviver(net.hidden)
    torch.manual_seed(100 + rank)  # per-rank input noise
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1536, 12, generator=g)
    y = x[:, :3].sum(1) + 0.1 * torch.randn(1536, generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb = xb + 0.01 * torch.randn_like(xb)
            loss = F.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            revived = reviver.maybe_revive(step)
            if revived and rank == 0:
                print(f"step {step}: revived {revived} units", flush=True)
            step += 1
    print(f"rank {rank} loss {loss.item():.4f} hidden checksum {net.hidden.weight.sum().item():.6f}",
          flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(net.state_dict(), "/tmp/dead_unit_revival.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
