"""The classic: rank 0 evaluates through the DDP wrapper with grad enabled; the model has
BatchNorm buffers, so the wrapper broadcasts them, a collective rank 1 (waiting in barrier())
never joins."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "rank_only_eval", "rank": 0, "fix": "model.module", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def evaluate(model, val) -> float:
    model.eval()
    out = model(val)  # zoo: place
    model.train()
    return out.mean().item()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if rank == 0:
        print("val", evaluate(model, torch.randn(16, 16)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
