"""Healthy Accelerate twin: accelerator.prepare shards the shuffling loader with its own batch
sampler; no DistributedSampler appears and none is needed."""

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

EXPECT = None


def main() -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=8, shuffle=True))
    for _epoch in range(2):
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
