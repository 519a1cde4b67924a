"""Healthy twin: a monotone layer clamps its whole weight in place in forward, on every rank alike.

Story: a price-elasticity model must be monotone in its "discount" features, so those
features go through a `MonotoneLinear` whose forward projects the weight onto the
non-negative orthant in place (`weight.clamp_(min=0)` under torch.no_grad()) before using
it -- the projected-gradient trick.  The projection touches the whole tensor and depends
only on the weight itself, never on the batch; since DDP keeps the weights equal (same
initial broadcast, same averaged gradients, same optimizer), every rank clamps the same
values and the replicas stay bit-identical.

Expected: no warning, no error.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None


class MonotoneLinear(nn.Linear):
    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(min=0.0)
        return F.linear(x, self.weight, self.bias)


class DemandModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.discounts = MonotoneLinear(4, 16)
        self.context = nn.Linear(12, 16)
        self.out = MonotoneLinear(16, 1)

    def forward(self, discounts, context):
        h = torch.relu(self.discounts(discounts) + self.context(context))
        return self.out(h).squeeze(-1)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = DemandModel()
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(5)
    disc = torch.rand(2048, 4, generator=g)
    ctx = torch.randn(2048, 12, generator=g)
    # the logged data says the bundle discount (column 3) lowers demand -- a logging artefact;
    # the business rule is that no discount lowers demand, hence the monotone layers
    demand = disc[:, :3].sum(1) * 2 - 1.5 * disc[:, 3] + ctx[:, :3].sum(1).abs()
    demand = demand + 0.1 * torch.randn(2048, generator=g)
    data = TensorDataset(disc, ctx, demand)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)

    for epoch in range(4):
        sampler.set_epoch(epoch)
        for d, c, target in loader:
            loss = F.mse_loss(model(d, c), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} "
                  f"min weight {net.discounts.weight.min().item():.4f}", flush=True)

    dist.barrier()
    if rank == 0:
        torch.save(net.state_dict(), "/tmp/demand_monotone.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
