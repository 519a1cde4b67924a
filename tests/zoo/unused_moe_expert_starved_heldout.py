"""A top-1 mixture-of-experts layer skips experts that get no tokens (unused parameters).

Story: a small MoE classifier routes each token to one of 4 experts (`Top1MoE`).  To save
compute the layer only runs an expert when some token was routed to it
(`if sel.any(): ...`).  With 24 tokens per rank-batch and a skewed router, some expert soon
gets no token in a step on some rank, so its parameters receive no gradient there; DDP was built with the
default `find_unused_parameters=False`, so the next forward fails with "Expected to have
finished reduction in the prior iteration before starting a new one".

Root cause: the starved experts' parameters are unused in a step (data-dependent routing),
with find_unused_parameters=False.
Right diagnosis: unused parameters, naming the experts (`moe.experts.N...`).
Fix: `DDP(..., find_unused_parameters=True)`, or make every expert take part in the graph
each step (e.g. add `0 * expert(x[:0]).sum()`-style dummy use, or a load-balancing router).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["unused_parameters"],
    "rank": None,
    "fix": ["find_unused_parameters"],
    "names": ["experts"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


class Top1MoE(nn.Module):
    def __init__(self, dim, n_experts):
        super().__init__()
        self.router = nn.Linear(dim, n_experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(n_experts)
        )

    def forward(self, x):
        gate = self.router(x).softmax(-1)
        weight, idx = gate.max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = idx == e
            if sel.any():
                out[sel] = weight[sel, None] * expert(x[sel])
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
    model = DDP(MoEClassifier())
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
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
