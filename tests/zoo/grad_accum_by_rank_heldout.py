"""Gradient accumulation sized per rank: the micro-batch comes from a per-rank memory table
(rank 0 also hosts the logger, so it gets the smaller one) and the accumulation steps are
derived from it, but every rank runs the same number of micro-steps per epoch. Rank 0 syncs
gradients every 4th micro-step, rank 1 every 2nd: the ranks' gradient all-reduces first part
at rank 1's 2nd micro-step and keep pairing with the wrong partner until the end."""

import contextlib
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None, "rank": None, "fix": ["accum", "no_sync"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

GLOBAL_BATCH = 64
MICRO_STEPS_PER_EPOCH = 16
MICRO_BATCH = {0: 8, 1: 16}  # fits in each rank's memory


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_bs = MICRO_BATCH[rank]
    accum_steps = GLOBAL_BATCH // (micro_bs * world)  # zoo: place
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    loader = DataLoader(data, batch_size=micro_bs, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = itertools.cycle(loader)
    for micro in range(MICRO_STEPS_PER_EPOCH):
        x, y = next(batches)
        boundary = (micro + 1) % accum_steps == 0  # zoo: place
        with contextlib.nullcontext() if boundary else model.no_sync():
            loss = nn.functional.cross_entropy(model(x), y) / accum_steps
            loss.backward()
        if boundary:
            opt.step()
            opt.zero_grad()
    summary = torch.tensor([loss.item() * accum_steps])
    dist.all_reduce(summary)
    if rank == 0:
        print(f"last loss {summary.item() / world:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
