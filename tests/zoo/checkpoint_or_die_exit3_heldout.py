"""Rank 0 saves a checkpoint every 10 steps through a small 'utility library' helper,
checkpoint_or_die(), written the way some third-party helpers are: on any OSError it logs and
calls sys.exit(3) instead of raising. The configured checkpoint directory was never created
(a typo in the run config), so the very first save at step 10 fails and rank 0 quietly exits
with status 3, no traceback. Rank 1 does not save; it keeps training and blocks in the next
gradient all-reduce. The root is rank 0 (exit status 3)."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": None, "rank": 0, "fix": ["checkpoint", "exit", "raise"], "names": [["code 3", "status 3"]], "options": []}


# ---- "ckptutils" (vendored third-party helper) -------------------------------------------
def checkpoint_or_die(state: dict, path: str) -> None:
    try:
        with open(path, "wb") as fh:
            torch.save(state, fh)
    except OSError as exc:
        sys.stderr.write(f"ckptutils: cannot write checkpoint {path}: {exc.strerror}\n")
        sys.exit(3)  # zoo: place
# -------------------------------------------------------------------------------------------


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt_dir = os.path.join("/tmp", f"heldout8-ckpts-{os.getpid()}-does-not-exist", "run7")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(384, 20), torch.randint(0, 5, (384,)))
    sampler = DistributedSampler(data, seed=1)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(20, 40), nn.ReLU(), nn.Linear(40, 5)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, (x, y) in enumerate(loader, start=1):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if rank == 0 and step % 10 == 0:
            checkpoint_or_die({"step": step, "model": model.module.state_dict(),
                               "opt": opt.state_dict()}, os.path.join(ckpt_dir, f"step{step}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
