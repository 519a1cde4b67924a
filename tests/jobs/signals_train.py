"""A DDP job with its own signal handlers, which must keep working under ddpdoctor.

SIGUSR1: the job signals itself once and its handler prints "usr1 handled".
SIGTERM: its handler prints "term handled RANK" and exits 0.
It runs 5 DDP steps, rank 0 prints "ready", then computes locally (no collectives) until a
signal arrives, so every rank's Python handler can run at once (a rank blocked in a collective
could not, with or without ddpdoctor).
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def say(text: str) -> None:
    """One write per line: ranks share torchrun's unbuffered stdout, print() writes twice."""
    os.write(1, f"{text}\n".encode())


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(nn.Linear(8, 2))
    got_usr1 = []
    signal.signal(signal.SIGUSR1, lambda s, f: got_usr1.append(s))

    def on_term(signum, frame):
        say(f"term handled {rank}")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(500):  # the handler runs at the main thread's next check, not at once
        if got_usr1:
            break
        time.sleep(0.01)
    if got_usr1:
        say(f"usr1 handled {rank}")
    for _ in range(5):
        model(torch.randn(4, 8)).sum().backward()
    dist.barrier()
    if rank == 0:
        say("ready")
    while True:
        model.module(torch.randn(4, 8)).sum().backward()
        time.sleep(0.01)


if __name__ == "__main__":
    main()
