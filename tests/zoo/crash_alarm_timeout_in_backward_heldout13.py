"""Small conv classifier, data parallel with an explicit gradient all-reduce after backward.  A
SIGALRM watchdog times each step's local compute: `signal.setitimer(ITIMER_REAL, 0.25)` before
forward, disarmed after backward (the all-reduce may wait for a slower peer, so it is left out);
the handler raises TimeoutError.  A custom autograd Function taps the feature gradients for a
per-rank stats file.  At step 4 rank 1's stats write stalls (a sleep stands in for a slow shared
filesystem), so rank 1's alarm fires inside `loss.backward()` and rank 1 dies with TimeoutError;
rank 0 is already waiting in the gradient all-reduce and only sees the connection close."""

import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "rank_failure", "rank": 1, "fix": "", "options": []}

STEP_BUDGET_S = 0.25
GRAD_STATS = []


class GradTap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, step):
        ctx.step = step
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if dist.get_rank() == 1 and ctx.step == 4:
            time.sleep(0.5)  # stands in for the stats write stalling on NFS  # zoo: place
        GRAD_STATS.append((ctx.step, grad.abs().mean().item()))
        return grad, None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.fc = nn.Linear(64, 10)

    def forward(self, x, step):  # 16x16 digits -> 10 classes
        return self.fc(GradTap.apply(self.conv(x).flatten(1), step))


def on_alarm(signum, frame):
    raise TimeoutError(f"training step exceeded {STEP_BUDGET_S}s watchdog budget")


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(640, 1, 16, 16), torch.randint(0, 10, (640,)))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0))
    model = Net()
    world = dist.get_world_size()
    for p in model.parameters():
        dist.broadcast(p.data, src=0)  # same initial weights on every rank
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    signal.signal(signal.SIGALRM, on_alarm)
    for step, (x, y) in enumerate(loader):
        signal.setitimer(signal.ITIMER_REAL, STEP_BUDGET_S)
        opt.zero_grad()
        loss = F.cross_entropy(model(x, step), y)
        loss.backward()
        signal.setitimer(signal.ITIMER_REAL, 0)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
