"""Accelerate with an auxiliary head whose output is never used: DDP fails at the second step.
The fix in Accelerate's terms: DistributedDataParallelKwargs(find_unused_parameters=True)."""

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {"kind": "unused_parameters", "rank": None, "fix": "DistributedDataParallelKwargs", "options": ["--hang-timeout", "10", "--on-hang", "kill"]}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.aux = nn.Linear(32, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head(h), self.aux(h)


def main() -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=8))
    for x, y in loader:
        opt.zero_grad()
        logits, _aux = model(x)  # zoo: place
        accelerator.backward(nn.functional.cross_entropy(logits, y))
        opt.step()


if __name__ == "__main__":
    main()
