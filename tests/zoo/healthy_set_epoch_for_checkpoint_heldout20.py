"""Healthy twin: each launch trains one epoch, then calls set_epoch(epoch + 1) for its checkpoint.

Story: a delivery-time regressor trained on preemptible capacity that hands the job one-epoch
slots.  Every launch resumes from the last checkpoint, builds its data pipeline, trains
`EPOCHS_PER_SLOT = 1` epoch and stops.  Before saving, it advances the sampler with
`sampler.set_epoch(epoch + 1)` and stores `sampler.epoch`, so that the next launch resumes
with the next shuffle; no training step follows that set_epoch in the launch that made it.
The team's smoke test replays five launches in one process group (`run_slot` five times,
sharing a temporary checkpoint directory), which is what this script does.  Each launch
reads the epoch from the checkpoint and calls `set_epoch` with it before iterating its
loader, so the five epochs draw five different DistributedSampler orders.  The model is
loaded from the checkpoint before it is wrapped in DDP.  Nothing is wrong here.
"""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = None

EPOCHS_PER_SLOT = 1
SLOTS = 5
N_ZONES = 24


class DeliveryTimes(Dataset):
    """Synthetic orders: distance, prep time, hour, weekday, courier load, zone -> minutes."""

    def __init__(self, n=1088, seed=31):
        g = torch.Generator().manual_seed(seed)
        self.zone = torch.randint(0, N_ZONES, (n,), generator=g)
        dist_km = 0.5 + 7.5 * torch.rand(n, generator=g)
        prep = 5 + 20 * torch.rand(n, generator=g)
        hour = torch.randint(10, 23, (n,), generator=g).float()
        weekday = torch.randint(0, 7, (n,), generator=g).float()
        load = torch.rand(n, generator=g)
        zone_delay = torch.randn(N_ZONES, generator=g) * 3
        rush = ((hour >= 12) & (hour <= 13)) | ((hour >= 18) & (hour <= 20))
        minutes = (prep + 4.0 * dist_km + 6.0 * rush.float() + 8.0 * load ** 2
                   + zone_delay[self.zone] + 2.0 * torch.randn(n, generator=g))
        self.x = torch.stack([dist_km / 8, prep / 25, hour / 23, weekday / 6, load], 1)
        self.y = minutes / 30

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.zone[i], self.y[i]


class EtaRegressor(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.zone = nn.Embedding(N_ZONES, 8)
        self.mlp = nn.Sequential(nn.Linear(5 + 8, hidden), nn.SiLU(),
                                 nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, x, zone):
        return self.mlp(torch.cat([x, self.zone(zone)], 1)).squeeze(1)


def run_slot(ckpt_dir):
    """One launch: resume, train EPOCHS_PER_SLOT epochs, advance the sampler, checkpoint."""
    rank = dist.get_rank()
    path = os.path.join(ckpt_dir, "last.pt")
    state = torch.load(path, map_location="cpu") if os.path.exists(path) else None

    data = DeliveryTimes()
    sampler = DistributedSampler(data, shuffle=True, seed=13)
    loader = DataLoader(data, batch_size=34, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    net = EtaRegressor()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    start = 0
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["sampler_epoch"]
    model = DDP(net)

    for epoch in range(start, start + EPOCHS_PER_SLOT):
        sampler.set_epoch(epoch)
        total, seen = 0.0, 0
        for x, zone, y in loader:
            loss = F.smooth_l1_loss(model(x, zone), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(y)
            seen += len(y)
        if rank == 0:
            print(f"epoch {epoch}: loss {total / seen:.4f}", flush=True)

    # the slot is over: record where the next launch resumes (no steps after this)
    sampler.set_epoch(epoch + 1)
    if rank == 0:
        torch.save({"model": net.state_dict(), "optim": opt.state_dict(),
                    "sampler_epoch": sampler.epoch}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def main():
    dist.init_process_group("gloo")
    box = [tempfile.mkdtemp(prefix="eta_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ckpt_dir = box[0]
    try:
        for _ in range(SLOTS):
            run_slot(ckpt_dir)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
