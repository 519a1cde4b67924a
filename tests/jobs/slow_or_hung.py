"""A small DDP job whose rank 0 is slow, stuck or gone on purpose; ``--mode`` picks how.

slow_eval   rank 0 evaluates ``model.module`` (no collectives) for --busy-s seconds after the
            first epoch while rank 1 waits in dist.barrier(); then both go on and exit 0
slow_ckpt   rank 0 writes checkpoints for --busy-s seconds (torch.save, fsync) while rank 1
            waits in dist.barrier(); exit 0
sleep       rank 0 sleeps in user code (no CPU, the same stack) while rank 1 waits in
            dist.barrier(): stalled, a hang once the threshold passes
early_exit  rank 1 returns (exit code 0) before the last all_reduce that rank 0 waits in
backward_sleep
            rank 0 sleeps inside the second epoch's first backward (a custom autograd
            Function's), after its last layer's gradient bucket was reduced: rank 1 waits
            for the next bucket
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def evaluate(model: nn.Module, seconds: float) -> float:
    """CPU work for ``seconds``: forward passes on the bare module, as a rank-0-only eval does."""
    x = torch.randn(256, 64)
    total, deadline = 0.0, time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < deadline:
            total += float(model(x).mean())
    return total


def save_checkpoint(model: nn.Module, path: str, seconds: float) -> None:
    """Write checkpoints for ``seconds`` (a large state dict, flushed to disk each time)."""
    state = {k: v.repeat(64, 1) if v.dim() else v for k, v in model.state_dict().items()}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with open(path, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())


def wait_for_peer() -> None:
    time.sleep(3600)


class SleepInBackward(torch.autograd.Function):
    """The identity; its backward sleeps on rank 0 once ``armed`` (a hang inside a backward)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if SleepInBackward.armed:
            wait_for_peer()
        return grad


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SleepInBackward.apply(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="slow_eval")
    parser.add_argument("--busy-s", type=float, default=40.0)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if args.mode == "backward_sleep":
        # The last layer (1 MiB) fills DDP's first bucket: it is reduced before the Gate's backward.
        net = nn.Sequential(nn.Linear(64, 128), Gate(), nn.ReLU(), nn.Linear(128, 2048))
        model = DDP(net, bucket_cap_mb=1)
    else:
        net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 2))
        model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 64), torch.randint(0, 2, (16,))
    for epoch in range(2):
        for _ in range(args.steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if epoch == 0 and rank == 0:
            if args.mode == "slow_eval":
                evaluate(model.module, args.busy_s)
            elif args.mode == "slow_ckpt":
                save_checkpoint(model.module, os.path.join(os.getcwd(), "ckpt.pt"), args.busy_s)
            elif args.mode == "sleep":
                wait_for_peer()
            elif args.mode == "backward_sleep":
                SleepInBackward.armed = True
        dist.barrier()
        if args.mode == "early_exit" and rank == 1 and epoch == 1:
            return  # leaves early and cleanly: rank 0 waits in the all_reduce below alone
        dist.all_reduce(torch.ones(8))
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
