"""A healthy DDP job that runs long enough to be watched: --steps steps of about --step-s each.

With --hold-at K every rank stops after K steps until the file --release exists (rank 0 polls
for it, the others wait in a barrier), so a test can look at the job at a known step count.
Prints "training" after the first step and "held" when it holds (rank 0), flushed.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--step-s", type=float, default=0.03)
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--release", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randint(0, 2, (8,))
    for step in range(args.steps):
        if step == args.hold_at:
            if rank == 0:
                print("held", flush=True)
                while not os.path.exists(args.release):
                    time.sleep(0.1)
            dist.barrier()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(args.step_s)
        if step == 0 and rank == 0:
            print("training", flush=True)
    dist.barrier()
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
