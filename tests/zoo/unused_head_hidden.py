"""An auxiliary head that no rank ever trains (its output never reaches the loss), hidden by
find_unused_parameters=True: the job runs, DDP skips the head every step. A waste or a bug, so
a warning, whatever the flag says."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "unused_parameters", "rank": None, "fix": "connect", "options": []}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.aux_head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.head(h), self.aux_head(h)


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(Net(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:
        opt.zero_grad()
        logits, _aux = model(x)
        nn.functional.cross_entropy(logits, y).backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
