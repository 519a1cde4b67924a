"""Rank 0 loads "pretrained" weights into ddp.module after wrapping: DDP's constructor
broadcast never sees them, both ranks train to the end and exit 0 with different weights."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "weights_diverged", "rank": 0, "fix": "before wrapping", "options": []}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    if rank == 0:
        pretrained = {k: torch.randn_like(v) for k, v in model.module.state_dict().items()}
        model.module.load_state_dict(pretrained)  # zoo: place
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            hold()
    print(f"rank {rank}: checksum {sum(p.sum().item() for p in model.parameters()):.2f}")
    dist.destroy_process_group()


def hold() -> None:
    """With RELEASE_FILE set (the live test runs `ddpdoctor top` meanwhile): wait after the first
    optimizer step until that file exists."""
    import os
    import time

    path = os.environ.get("RELEASE_FILE")
    while path and not os.path.exists(path):
        time.sleep(0.05)


if __name__ == "__main__":
    main()
