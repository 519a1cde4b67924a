"""Jobs for the gradient-sync and checkpoint findings.

Usage: sync_cost.py {one_bucket|split_buckets|save_everywhere|save_rank0|buffers} OUT_DIR
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if mode in ("one_bucket", "split_buckets"):  # 16.8 MB of gradients, little compute
        model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024))
        ddp = DDP(model, bucket_cap_mb=100 if mode == "one_bucket" else 4)
        width, steps = 1024, 12
    else:
        model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
        ddp = DDP(model)
        width, steps = 16, 20
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(8, width)).pow(2).mean().backward()
        opt.step()
    path = os.path.join(out, "ckpt.pt")
    if mode == "save_everywhere":
        torch.save(ddp.state_dict(), path)  # both classic mistakes: every rank, "module." keys
    elif mode == "save_rank0":
        if dist.get_rank() == 0:
            torch.save(ddp.module.state_dict(), path)
        dist.barrier()
        torch.load(path)  # on CPU no map_location is needed
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
