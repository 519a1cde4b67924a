"""Every 3rd step rank 1 (the "checkpoint rank" in this job) pickles a portable copy of the
model's state_dict (tensors as plain lists) together with the recent losses and writes it to
a file with os.fsync, between optimizer.step() and the next forward. Rank 0 waits for it at
the next gradient all-reduce."""

import os
import pickle
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "periodic_rank_work", "rank": 1,
          "fix": ["background", "less often", "asynchronous", "every rank"], "options": []}

STEPS = 45
PERIOD = 3


def save_snapshot(model: nn.Module, losses: list, path: str) -> None:
    state = {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()}
    blob = pickle.dumps({"state": state, "losses": list(losses)}, protocol=pickle.HIGHEST_PROTOCOL)
    with open(path, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * 16, 64), torch.randint(0, 10, (STEPS * 16,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(64, 640), nn.ReLU(), nn.Linear(640, 640), nn.ReLU(),
                              nn.Linear(640, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outdir = tempfile.mkdtemp(prefix="snap_")
    losses = []
    try:
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if rank == 1 and step % PERIOD == PERIOD - 1:
                save_snapshot(model.module, losses[-50:], os.path.join(outdir, "snapshot.pkl"))  # zoo: place
        if rank == 1:
            print(f"final loss {losses[-1]:.3f}")
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
