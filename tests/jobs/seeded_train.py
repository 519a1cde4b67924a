"""Seeded DDP training that saves its final parameters: the bit-identity check's patient.

Usage: seeded_train.py OUT.pt [--hook user|late|none] [--epochs N] [--sleep-ms MS] [--deep N] [--width W]

--hook late: the user's hook is registered after the first epoch (DDP's slot may hold a timer).

--sleep-ms: each step also waits that long (a step long enough for bucket timing).
--deep: N more 64x64 layers, a gradient bucket each (many buckets in a millisecond step).
--width: the deep layers' width (64): at 512, 1 MB of gradients each.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def user_hook(state, bucket):
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--hook", default="none")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--deep", type=int, default=0)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)
    data = TensorDataset(torch.randn(480, 20), torch.randint(0, 5, (480,)))
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    w = args.width
    deep = [nn.Linear(64 if i == 0 else w, w) for i in range(args.deep)]
    last = w if deep else 64
    model = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), *deep, nn.Linear(last, 5))
    ddp = DDP(model, bucket_cap_mb=0.016 if deep else 0.005)  # --deep: a bucket per 64x64 layer
    if args.hook == "user":
        ddp.register_comm_hook(None, user_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        if args.hook == "late" and epoch == 1:
            ddp.register_comm_hook(None, user_hook)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            time.sleep(args.sleep_ms / 1e3)
        dist.barrier()
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
