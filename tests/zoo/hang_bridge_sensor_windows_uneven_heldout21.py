"""Bridge vibration autoencoder: rank 1 runs out of windows first and waits in a barrier forever.

Story: an anomaly detector for a footbridge's accelerometers is trained as a 1-D convolutional
autoencoder on sliding windows (128 samples, hop 64) of each sensor's recording.  The six
sensors are split between the ranks by index parity and each rank cuts its own windows.  All
recordings are 2,400 samples long except sensor 3's (rank 1): its logger was offline for part
of the campaign and its file holds only 1,600 samples.  Rank 0 gets 108 windows (9 batches of
12), rank 1 gets 96 (8 batches).  After its 8th batch rank 1 leaves the epoch's loop and
enters the `dist.barrier()` placed before rank 0 writes the epoch checkpoint; rank 0 is still
training its 9th batch and waits in that step's gradient all-reduce, which rank 1 never
joins.  No error, no progress: the job hangs until it is killed.

Root cause: rank 1, which ran out of batches first (its shard is built from sensors with a
shorter recording; the per-rank split by sensor gives the ranks different window counts).
Fix: wrap the loop in `model.join()` / `Join([model])`, or shard windows (not sensors) with a
DistributedSampler so every rank gets the same number of batches (pad or drop_last), or cut
every rank to the smallest count.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["uneven_inputs"],
    "rank": 1,
    "fix": ["join", "Join", "DistributedSampler", "drop_last", "pad", "same number",
            "equal", "truncate", "min(", "smallest", "fewer"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
    "names": ["from 96 samples", "differ in length"],
}

WIN, HOP = 128, 64
SENSORS = 6


def recording(sensor):
    n = 1600 if sensor == 3 else 2400  # sensor 3's logger was offline for a while
    g = torch.Generator().manual_seed(50 + sensor)
    t = torch.arange(n) / 200.0
    modes = sum(torch.sin(2 * torch.pi * f * t + float(torch.rand(1, generator=g)) * 6.28)
                for f in (2.1, 5.7, 9.3))
    return 0.4 * modes + 0.1 * torch.randn(n, generator=g)


def windows(signal):
    return signal.unfold(0, WIN, HOP)


class ConvAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv1d(1, 16, 7, stride=2, padding=3), nn.ReLU(),
                                 nn.Conv1d(16, 32, 7, stride=2, padding=3), nn.ReLU())
        self.dec = nn.Sequential(nn.ConvTranspose1d(32, 16, 4, stride=2, padding=1), nn.ReLU(),
                                 nn.ConvTranspose1d(16, 1, 4, stride=2, padding=1))

    def forward(self, x):
        return self.dec(self.enc(x.unsqueeze(1))).squeeze(1)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(ConvAE())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    mine = torch.cat([windows(recording(s)) for s in range(rank, SENSORS, world)])  # zoo: place
    loader = DataLoader(TensorDataset(mine), batch_size=12, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))
    ckpt_dir = tempfile.mkdtemp(prefix="bridge_ae_")
    for epoch in range(3):
        total, n = 0.0, 0
        for (x,) in loader:
            loss = F.mse_loss(model(x), x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            n += 1
        print(f"rank {rank} epoch {epoch}: {n} batches, recon {total / n:.4f}", flush=True)
        dist.barrier()  # everyone done before rank 0 saves
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(ckpt_dir, f"ae_{epoch}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
