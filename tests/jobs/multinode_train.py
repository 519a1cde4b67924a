"""A small DDP job for two launchers standing for two nodes; ``--mode`` picks what goes wrong.

* ``eval0``: rank 0 evaluates through the DDP wrapper (a buffer broadcast nobody joins) while
  the others wait in ``dist.barrier()``: a proven hang across nodes.
* ``stall``: at step ``--at`` the last rank blocks forever on a lock in its own data code
  (idle, outside every sync point) while the others wait in that step's gradient all-reduce.
* ``longeval``: healthy: rank 0 evaluates ``model.module`` for ``--eval-s`` seconds (busy)
  while the others wait in a barrier, then every rank trains on and exits 0.
* ``healthy``: trains ``--steps`` steps, with ``--step-s`` of work per step.
* ``failend``: trains, then the last rank raises after ``destroy_process_group`` (writing its
  results) while the others exit 0: their launcher waits in torchrun's exit barrier.
"""

import argparse
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

LOCK = threading.Lock()


def next_batch(step: int, rank: int, stall_at: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    if step == stall_at and rank == last:
        LOCK.acquire()
        LOCK.acquire()  # the data code's lock, taken twice: blocks forever
    g = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def evaluate(model: nn.Module, seconds: float) -> float:
    end, total = time.time() + seconds, 0.0
    with torch.no_grad():
        while time.time() < end:
            total += float(model(torch.randn(64, 32)).sum())
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="healthy")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--at", type=int, default=15)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--eval-s", type=float, default=8.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stall_at = args.at if args.mode == "stall" else -1
    for step in range(args.steps):
        x, y = next_batch(step, rank, stall_at, world - 1)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if args.step_s:
            time.sleep(args.step_s)
        if args.mode == "longeval" and step == args.at and rank == 0:
            evaluate(model.module, args.eval_s)  # the right way: no collectives, only slow
        if args.mode == "longeval" and step == args.at:
            dist.barrier()
    if args.mode == "eval0" and rank == 0:
        model.eval()
        with torch.no_grad():
            model(torch.randn(8, 32))  # through the wrapper: a broadcast the others never join
    dist.barrier()
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()
    if args.mode == "failend" and rank == world - 1:
        raise OSError(f"could not write results-rank{rank}.json: No space left on device")


if __name__ == "__main__":
    main()
