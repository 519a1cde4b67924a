"""Healthy twin of the checkpoint helper case: the same vendored checkpoint_or_die() helper
(which would sys.exit(3) on an OSError) is used, but the directory exists, so the saves succeed.
Rank 0 saves at steps 10 and 20 and a final checkpoint after training (the other rank waits
for it at a barrier), reloads it to check it, then every rank destroys the process group and
does `raise SystemExit(0)`. Exit status 0 everywhere; the exit path in the helper never runs."""

import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


# ---- "ckptutils" (vendored third-party helper) -------------------------------------------
def checkpoint_or_die(state: dict, path: str) -> None:
    try:
        with open(path, "wb") as fh:
            torch.save(state, fh)
    except OSError as exc:
        sys.stderr.write(f"ckptutils: cannot write checkpoint {path}: {exc.strerror}\n")
        sys.exit(3)
# -------------------------------------------------------------------------------------------


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt_dir = tempfile.mkdtemp(prefix="heldout8-ckpt-") if rank == 0 else None
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
    if rank == 0:
        final = os.path.join(ckpt_dir, "final.pt")
        checkpoint_or_die({"model": model.module.state_dict()}, final)
        restored = torch.load(final)["model"]
        assert all(torch.equal(restored[k], v) for k, v in model.module.state_dict().items())
        print(f"saved {sorted(os.listdir(ckpt_dir))}", flush=True)
        shutil.rmtree(ckpt_dir)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0)


if __name__ == "__main__":
    main()
