"""A short job: 3 epochs x 8 steps = 24 steps. At the last step of every epoch (every 8th step)
rank 1 alone serialises a big per-sample statistics dict to JSON and writes it to a temporary
file (about 80 ms of work); rank 0 waits for it at the next gradient all-reduce (or, after the
last epoch, at the final barrier)."""

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": "periodic_rank_work",
    "rank": 1,
    "fix": ["background", "less often", "asynchronous", "every rank"],
    "options": [],
}


def dump_stats(epoch: int, loss: float) -> None:
    stats = {
        f"sample_{i}": {"loss": loss * (1 + i % 7) / 7, "hist": [round(j * 0.37 + i, 3) for j in range(12)]}
        for i in range(2000)
    }
    fd, path = tempfile.mkstemp(prefix=f"stats_e{epoch}_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(stats, indent=1))
    os.remove(path)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if rank == 1 and step % 8 == 7:
                dump_stats(epoch, loss.item())  # zoo: place
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
