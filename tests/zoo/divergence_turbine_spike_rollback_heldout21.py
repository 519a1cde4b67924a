"""Wind-turbine power curves: a loss-spike guard rolls back the update on rank 1 only.

Story: a regression of turbine power output (as a fraction of rated power) from SCADA
features (wind speed, direction, air density, pitch, rotor speed), trained on eight
turbines, each rank reading four of them.  The team ported a `SpikeGuard` from their
single-process trainer: before each optimizer step it snapshots the weights, and after the
step, if the batch's loss was more than 6x the running average, it copies the snapshot back
("discard the update from a poisoned batch").  In DDP the loss it looks at is the rank's own.
Turbine 5 (rank 1) had a firmware update that logs power in W instead of kW for part of the
year, so rank 1 sees a loss spike on several batches and restores its weights, while rank 0,
whose turbines are clean, keeps the (shared, all-reduced) update.  From the first spike on the
two replicas hold different weights; nothing fails, the job exits 0, and rank 0's checkpoint
is not the model rank 1 evaluated.

Root cause: rank 1 (the in-place `p.copy_(saved)` of SpikeGuard.after_step, a rank-dependent
change of the parameters outside autograd after DDP wrapped them).
Fix: decide the rollback collectively (all_reduce the spike flag or the loss so every rank
restores or none does), or skip the step on every rank; better, fix the units of turbine 5.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["weights_diverged"],
    "rank": 1,
    "fix": ["all_reduce", "every rank", "all ranks", "each rank", "collective", "agree",
            "global", "broadcast", "same decision", "rank-dependent", "rank dependent",
            "restore", "rollback", "roll back", "units", "after wrapping", "outside"],
    "options": [],
}

TURBINES = 8
ROWS = 384


def scada(turbine):
    g = torch.Generator().manual_seed(900 + turbine)
    wind = torch.rand(ROWS, generator=g) * 20
    direction = torch.rand(ROWS, generator=g) * 6.283
    density = 1.225 + 0.05 * torch.randn(ROWS, generator=g)
    pitch = torch.clamp(wind - 12, min=0) * 2 + torch.randn(ROWS, generator=g)
    rpm = torch.clamp(wind * 1.1, max=14) + 0.3 * torch.randn(ROWS, generator=g)
    x = torch.stack([wind / 20, direction.sin(), direction.cos(), density - 1.2, pitch / 20,
                     rpm / 14], 1)
    power = torch.clamp(((wind - 3) / 9).clamp(min=0) ** 3, max=1.0) * density / 1.225
    power = power + 0.02 * torch.randn(ROWS, generator=g)
    if turbine == 5:  # firmware logged W instead of kW for these rows
        power[150:170] *= 1000
    return x, power


class SpikeGuard:
    def __init__(self, model, factor=6.0):
        self.model, self.factor, self.avg, self.saved = model, factor, None, None

    def before_step(self):
        self.saved = [p.detach().clone() for p in self.model.parameters()]

    def after_step(self, loss):
        if self.avg is not None and loss > self.factor * self.avg:
            with torch.no_grad():
                for p, saved in zip(self.model.parameters(), self.saved):
                    p.copy_(saved)  # zoo: place
            return True
        self.avg = loss if self.avg is None else 0.9 * self.avg + 0.1 * loss
        return False


class PowerCurve(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                 nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(PowerCurve())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    guard = SpikeGuard(model)

    parts = [scada(t) for t in range(rank, TURBINES, world)]
    data = TensorDataset(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
    loader = DataLoader(data, batch_size=32, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))
    rollbacks = 0
    for epoch in range(3):
        for x, y in loader:
            loss = F.smooth_l1_loss(model(x), y, beta=0.1)
            opt.zero_grad()
            loss.backward()
            guard.before_step()
            opt.step()
            rollbacks += guard.after_step(loss.item())
        print(f"rank {rank} epoch {epoch}: loss {loss.item():.4f}, rollbacks so far {rollbacks}",
              flush=True)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {rank}: parameter checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
