"""A DDP job whose rank 1 dies (rank 0 in mode abort) at step ``--die-at`` in the way ``--mode`` names.

Every step prints "step RANK N" on stdout after its backward, so a test can compare what ran
with what the trace holds.

abort    each step all-reduces a metrics tensor; at the dying step rank 1's is larger: rank 0
         receives more than it expects, gloo throws gloo::EnforceNotMet on its I/O thread and
         rank 0 ends in std::terminate (SIGABRT); rank 1 then fails with "connection reset"
segv     rank 1 reads address 0 through ctypes (SIGSEGV)
sigkill  rank 1 sends itself SIGKILL
sigterm  rank 1 sends itself SIGTERM (no handler: the default action)
os_exit  rank 1 calls os._exit(7)
sys_exit rank 1 calls sys.exit(3): Python's own exit, with no traceback
c_exit   rank 1 calls the C library's exit(5), as native code may: Python's exit never runs
raise    rank 1 raises RuntimeError
"""

import argparse
import ctypes
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def say(text: str) -> None:
    os.write(1, f"{text}\n".encode())


def die(mode: str, step: int) -> None:
    if mode == "segv":
        ctypes.string_at(0)
    elif mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif mode == "os_exit":
        os._exit(7)
    elif mode == "sys_exit":
        sys.exit(3)
    elif mode == "c_exit":
        ctypes.CDLL(None).exit(5)
    elif mode == "raise":
        raise RuntimeError(f"rank 1 gives up at step {step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--die-at", type=int, default=9)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--step-s", type=float, default=0.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        if rank == 1 and step == args.die_at and args.mode != "abort":
            os.write(2, f"rank 1 dying by {args.mode} at step {step}\n".encode())
            die(args.mode, step)
        loss = model(torch.randn(4, 8)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        size = 4096 if (args.mode == "abort" and rank == 1 and step == args.die_at) else 2
        dist.all_reduce(torch.ones(size))
        say(f"step {rank} {step}")
        if args.step_s:
            time.sleep(args.step_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
