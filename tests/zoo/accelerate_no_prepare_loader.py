"""Accelerate, but the DataLoader is never passed to accelerator.prepare: every rank reads the
whole dataset in the same order (only the model was prepared)."""

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {"kind": "missing_distributed_sampler", "rank": None, "fix": "prepare", "options": []}


def main() -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = accelerator.prepare(model, opt)
    loader = DataLoader(data, batch_size=8, shuffle=True)  # zoo: place
    for _epoch in range(2):
        for x, y in loader:  # zoo: place
            opt.zero_grad()
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
