"""A warm-up head dropped after 3 steps on every rank: DDP without find_unused_parameters fails
at the next step."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "unused_parameters", "rank": None, "fix": "find_unused_parameters", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.warmup = nn.Linear(32, 4)

    def forward(self, x, warm: bool):
        h = torch.relu(self.body(x))
        return self.head(h) + (self.warmup(h) if warm else 0)


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        out = model(x, warm=step < 3)  # zoo: place
        nn.functional.cross_entropy(out, y).backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
