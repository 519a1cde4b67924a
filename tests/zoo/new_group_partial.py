"""Only rank 0 creates the process group it will log through (`dist.new_group([0, 1])` under
`if rank == 0:`): new_group is a collective of the default group, so rank 0 waits inside it
while rank 1 goes on to the next collective."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "rank_only_collective", "rank": 0, "fix": "new_group", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


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
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    if rank == 0:
        log_group = dist.new_group([0, 1])  # zoo: place
        dist.all_reduce(loss.detach(), group=log_group)
    dist.all_reduce(loss.detach())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
