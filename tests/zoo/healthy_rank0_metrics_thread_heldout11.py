"""Healthy job where rank 0 starts a background logging/metrics *thread* that wakes about
every 50 ms and spends a few ms of CPU summarising the latest losses, for the whole run. Both
ranks run identical training loops (40 steps); the thread only costs rank 0 a little CPU
now and then, never on a fixed step."""

import threading

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

STEPS = 40


class MetricsThread(threading.Thread):
    def __init__(self, losses: list) -> None:
        super().__init__(daemon=True, name="metrics")
        self.losses = losses
        self.stop = threading.Event()
        self.summaries = 0

    def run(self) -> None:
        buf = torch.randn(5000)
        while not self.stop.wait(0.05):
            recent = list(self.losses[-20:])
            mean = sum(recent) / max(len(recent), 1)
            for _ in range(5):  # a few ms of CPU: smoothing and quantiles
                buf = buf * 0.9 + mean * 0.1
                buf.sort()
            self.summaries += 1


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * 16, 32), torch.randint(0, 8, (STEPS * 16,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    metrics = None
    if rank == 0:
        metrics = MetricsThread(losses)
        metrics.start()
    for _step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if metrics is not None:
        metrics.stop.set()
        metrics.join()
        print(f"final loss {losses[-1]:.3f}, {metrics.summaries} metric summaries")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
