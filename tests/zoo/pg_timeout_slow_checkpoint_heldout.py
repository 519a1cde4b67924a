"""The job sets a short collective timeout (5 s) to fail fast; after epoch 0 rank 0 writes a
checkpoint through a slow save (12 s: many small synced writes) while rank 1 goes on into epoch
1 and waits in the first gradient all-reduce until gloo times out. The root is rank 0's
save_checkpoint(); rank 1's timeout is its consequence."""

import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None, "rank": 0, "fix": ["timeout", "background", "async"],
    "names": ["save_checkpoint"], "options": [],
}


def save_checkpoint(model: nn.Module, opt, path: str) -> None:
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    torch.save(state, path)
    block_size = os.path.getsize(path) // 100 + 1
    with open(path, "rb") as src, open(path + ".mirror", "wb") as dst:
        for block in iter(lambda: src.read(block_size), b""):
            dst.write(block)
            dst.flush()
            time.sleep(0.12)  # zoo: place
    os.remove(path + ".mirror")


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 20), torch.randint(0, 5, (256,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    net = nn.Sequential(nn.Linear(20, 20), nn.ReLU(), nn.Linear(20, 5))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = os.path.join(tempfile.gettempdir(), f"heldout-ckpt-{os.getppid()}.pt")
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if rank == 0:
            save_checkpoint(net, opt, ckpt)  # zoo: place
    if rank == 0 and os.path.exists(ckpt):
        os.remove(ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
