"""HEALTHY: a per-step SIGALRM watchdog with a generous budget that never fires.

Story: a small DDP conv classifier on 16x16 digits.  Every step arms
`signal.setitimer(ITIMER_REAL, 5.0)` (handler raises TimeoutError) and disarms it after
`opt.step()`; a custom autograd Function cheaply taps feature-gradient scale on both ranks.
Steps take milliseconds, so the alarm never goes off.  30 steps, barrier, clean exit.

Right diagnosis: nothing to report (no warning, no error).
"""

import signal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

STEP_BUDGET_S, STEPS = 5.0, 30
GRAD_STATS = []


class GradTap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        GRAD_STATS.append(grad.abs().mean().item())
        return grad


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(GradTap.apply(self.conv(x).flatten(1)))


def on_alarm(signum, frame):
    raise TimeoutError(f"training step exceeded {STEP_BUDGET_S}s watchdog budget")


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(960, 1, 16, 16), torch.randint(0, 10, (960,)))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0))
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    signal.signal(signal.SIGALRM, on_alarm)
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        signal.setitimer(signal.ITIMER_REAL, STEP_BUDGET_S)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        signal.setitimer(signal.ITIMER_REAL, 0)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f} tap {GRAD_STATS[-1]:.2e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
