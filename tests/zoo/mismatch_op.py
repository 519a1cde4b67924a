"""Rank 0 broadcasts the learning rate it computed while rank 1 all-reduces its own: two
different ops at the same collective sequence number."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "collective_mismatch", "rank": None, "fix": "same", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    lr = torch.tensor([0.01 * (rank + 1)] * 4)
    if rank == 0:
        dist.broadcast(lr, src=0)  # zoo: place
    else:
        dist.all_reduce(lr)  # zoo: place
    print(lr.tolist())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
