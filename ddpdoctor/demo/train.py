"""A small, correct DDP training job: DistributedSampler, set_epoch, a barrier per epoch.

Run it under the doctor with ``ddpdoctor demo`` (or ``ddpdoctor run -- torchrun
--nproc_per_node 2 train.py``). NCCL with one GPU per rank when there are enough GPUs, else gloo.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(1024, 64), torch.randint(0, 10, (1024,)))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    ).to(device)
    ddp = DDP(model, device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(ddp(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
