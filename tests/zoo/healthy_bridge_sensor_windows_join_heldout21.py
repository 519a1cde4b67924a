"""Bridge vibration autoencoder with uneven per-rank windows, handled by DDP's Join.

Story: the footbridge accelerometer autoencoder again: six sensors split between the ranks by
parity, sliding windows of 128 samples (hop 64), sensor 3's (rank 1) recording shorter
because its logger was offline.  Rank 0 has 9 batches per epoch, rank 1 has 8.  This time the
epoch loop runs under `Join([model])`: when rank 1 runs out it shadows rank 0's remaining
gradient all-reduce (contributing zeros), and the context manager returns on every rank
together (DDP's join hook broadcasts the final weights from the last rank to join; plain SGD
keeps no state that could drift meanwhile), so the barrier before rank 0 writes the
checkpoint is met by both ranks.  The uneven split is on purpose (each sensor's windows stay
on one rank for the per-sensor anomaly thresholds computed later), and Join is the documented
way to train on it.

Healthy twin of hang_bridge_sensor_windows_uneven: no warning or error expected.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

EXPECT = None

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
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # stateless: nothing drifts in shadowing

    mine = torch.cat([windows(recording(s)) for s in range(rank, SENSORS, world)])
    loader = DataLoader(TensorDataset(mine), batch_size=12, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))
    ckpt_dir = tempfile.mkdtemp(prefix="bridge_ae_")
    for epoch in range(3):
        total, n = 0.0, 0
        with Join([model]):
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
    checksum = sum(float(p.detach().double().sum()) for p in model.module.parameters())
    print(f"rank {rank} final parameter checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
