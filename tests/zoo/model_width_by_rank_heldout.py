"""The model's width comes from a per-host config, and rank 1's host has the newer file: its
projection layer `proj` is 48 wide where rank 0's is 32. DDP's constructor compares the
parameter shapes across ranks and fails. A right diagnosis names the module that differs (proj)
and where its size is chosen."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None, "rank": None, "fix": ["same", "identical", "every rank", "all ranks"], "names": ["proj"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

HOST_CONFIGS = [{"width": 32, "dropout": 0.1}, {"width": 48, "dropout": 0.1}]  # as read on each host


class Encoder(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 24)
        self.proj = nn.Linear(24, width)  # zoo: place
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.proj(torch.relu(self.embed(x))))))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = HOST_CONFIGS[rank % len(HOST_CONFIGS)]
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(Encoder(**cfg))  # zoo: place
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
