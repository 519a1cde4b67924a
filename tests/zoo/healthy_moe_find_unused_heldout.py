"""HEALTHY twin of unused_moe_expert_starved: the same sparse MoE, with find_unused_parameters.

Story: the same top-1 mixture-of-experts classifier that runs an expert only when some
token was routed to it, so in many steps some experts get no gradient on some rank.  Here
the model is wrapped with `DDP(..., find_unused_parameters=True)`, which is exactly what
that flag is for: DDP marks the starved experts ready after each backward and the
all-reduce completes.  Every expert is used in some steps (the script prints the routing
counts), so the flag is needed and no parameter is dead.  Exits 0.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None


class Top1MoE(nn.Module):
    def __init__(self, dim, n_experts):
        super().__init__()
        self.router = nn.Linear(dim, n_experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(n_experts)
        )
        self.routed = torch.zeros(n_experts, dtype=torch.long)  # local routing stats, not state

    def forward(self, x):
        gate = self.router(x).softmax(-1)
        weight, idx = gate.max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = idx == e
            if sel.any():
                out[sel] = weight[sel, None] * expert(x[sel])
        self.routed += torch.bincount(idx.detach(), minlength=len(self.experts))
        return x + out


class MoEClassifier(nn.Module):
    def __init__(self, dim=32, n_experts=4):
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.moe = Top1MoE(dim, n_experts)
        self.out = nn.Linear(dim, 4)

    def forward(self, x):
        return self.out(self.moe(torch.relu(self.inp(x))))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = MoEClassifier()
    model = DDP(net, find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(960, 16, generator=g)
    y = torch.randint(0, 4, (960,), generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=24, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for _step, (xb, yb) in enumerate(loader):
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.3f}", flush=True)
    print(f"rank {rank} tokens per expert {net.moe.routed.tolist()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
