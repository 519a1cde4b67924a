"""A small DDP job that goes wrong on purpose; ``--mode`` picks how.

eval0         rank 0 evaluates through the DDP wrapper (BatchNorm buffers -> broadcast), then
              every rank waits in dist.barrier(): the classic hang (pitfalls.md, trap 1)
skip_barrier  rank 1 skips a barrier and goes on to the next all_reduce
raise         rank 1 raises ValueError at step 3
sigkill       rank 1 kills itself with SIGKILL at step 3
userloop      rank 1 spins forever in user code before a step; rank 0 waits in backward
slow          healthy, but rank 1 is slow: --step-s seconds a step for 3 steps, then 2.5x that,
              so rank 0 waits in the gradient all-reduce longer than the first steps took
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def evaluate(model: nn.Module, x: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train()
    return float(out.mean())


def spin_forever() -> None:
    n = 0
    while True:
        n += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="slow")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--record", action="store_true", help="run main under torchrun's @record")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randint(0, 2, (8,))
    for step in range(args.steps):
        if args.mode == "userloop" and rank == 1 and step == 2:
            spin_forever()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if args.mode == "slow" and rank == 1:
            time.sleep(args.step_s if step < 3 else 2.5 * args.step_s)
        if step == 3 and rank == 1 and args.mode == "raise":
            raise ValueError("bad batch at step 3")
        if step == 3 and rank == 1 and args.mode == "sigkill":
            time.sleep(0.6)  # a little work first, as an OOM kill mid-training would interrupt
            os.kill(os.getpid(), signal.SIGKILL)
    if args.mode == "eval0" and rank == 0:
        evaluate(model, x)  # through the wrapper: a collective the other ranks never join
    if args.mode == "skip_barrier":
        if rank != 1:
            dist.barrier()
        dist.all_reduce(torch.ones(1))
    dist.barrier()
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "--record" in sys.argv:
        from torch.distributed.elastic.multiprocessing.errors import record

        record(main)()
    else:
        main()
