"""Accelerate, rank 1 slow at loading every batch (a per-batch decode in the main process): it
arrives last at every gradient sync, the time lost in data loading."""

import time

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

EXPECT = {"kind": "straggler", "rank": 1, "fix": "num_workers", "options": []}


class Slow(Dataset):
    def __init__(self, slow: bool) -> None:
        self.slow = slow
        self.x, self.y = torch.randn(640, 16), torch.randint(0, 4, (640,))

    def __len__(self) -> int:
        return 640

    def __getitem__(self, i):
        if self.slow:
            time.sleep(0.004)
        return self.x[i], self.y[i]


def main() -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Slow(accelerator.process_index == 1), batch_size=8)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for x, y in loader:
        opt.zero_grad()
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
