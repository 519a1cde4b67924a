"""Tabular churn classifier with per-layer gradient monitoring.  To spread the logging load,
each rank watches a different layer: right after `loss.backward()` returns, every 6 steps the
rank collects `grad.norm().item()` for all parameters into a dict keyed by parameter name and
looks up its watched layer.  Rank 1's entry was written for the model before the encoder got a
LayerNorm ("encoder.2.weight"), which is now "encoder.3.weight" in `named_parameters()`, so at
step 6 rank 1 raises KeyError between backward and the optimizer step; rank 0 has moved on to
step 7 and waits in the next all-reduce until the connection closes."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "rank_failure", "rank": 1, "fix": "", "options": []}

WATCHED = {0: "encoder.0.weight", 1: "encoder.2.weight"}
LOG_EVERY = 6


class Churn(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(20, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 32), nn.GELU())
        self.head = nn.Linear(32, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1024, 20, generator=g)
    y = ((x[:, 0] - x[:, 5] + 0.3 * torch.randn(1024, generator=g)) > 0).long()
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    net = Churn()
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for step, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if step and step % LOG_EVERY == 0:
            norms = {n: p.grad.norm().item() for n, p in net.named_parameters()}
            watched = WATCHED[rank]
            print(f"rank {rank} step {step} |g|[{watched}] = {norms[watched]:.4f}", flush=True)  # zoo: place
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
