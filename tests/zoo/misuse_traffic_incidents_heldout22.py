"""Short-term traffic speed forecasting for a city's road sensors.

A GRU forecaster predicts the next 15 minutes of loop-detector speed from the past hour. An
"incident branch" encodes police incident reports (lane closures, crashes) and adds a
correction; to save compute, IncidentAwareForecaster skips the branch when no sample in the
batch has an active incident. Each rank trains on the sensors of one district; rank 1's
district (suburban ring road) has few incidents, so some of its batches contain none.

Root cause: the forward pass skips the incident branch on batches without incidents, so on
rank 1 the incident encoder's parameters get no gradient in that iteration; the model is
wrapped without find_unused_parameters=True, DDP's reduction for that iteration never
finishes and the next forward raises "Expected to have finished reduction in the prior
iteration before starting a new one".
Fix: pass find_unused_parameters=True to DDP, or always run the incident branch (multiply
its output by the mask instead of skipping it) so every parameter takes part in every step.
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": ["unused_parameters", "rank_failure"],
    "rank": 1,
    "fix": [
        "find_unused_parameters",
        "unused",
        "always run",
        "every step",
        "mask",
        "branch",
        "skip",
        "incident",
        "static_graph",
        "all parameters",
        "gradient",
        "zero",
    ],
    "options": [],
}

PAST, HORIZON = 12, 3  # 5-minute bins


def synth_district(n, incident_rate, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(PAST + HORIZON).float()
    base = 60 + 10 * torch.sin((t[None, :] + 40 * torch.rand(n, 1, generator=g)) / 6.0)
    incident = (torch.rand(n, generator=g) < incident_rate).float()
    severity = incident * (0.5 + torch.rand(n, generator=g))
    drop = severity[:, None] * 25 * torch.sigmoid(t[None, :] - PAST + 2)
    speed = base - drop + 1.5 * torch.randn(n, PAST + HORIZON, generator=g)
    reports = torch.stack([incident, severity, incident * torch.rand(n, generator=g)], 1)
    return speed[:, :PAST, None] / 100, reports, speed[:, PAST:] / 100


class IncidentAwareForecaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(1, 32, batch_first=True)
        self.head = nn.Linear(32, HORIZON)
        self.incident_enc = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, HORIZON))

    def forward(self, speed, reports):
        _, h = self.gru(speed)
        out = self.head(h[-1])
        if reports[:, 0].sum() == 0:
            return out  # zoo: place
        return out - self.incident_enc(reports) * reports[:, :1]


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rate = 0.35 if rank == 0 else 0.22  # downtown vs suburban ring road
    x, rep, y = synth_district(2400, rate, seed=77 + rank)
    torch.manual_seed(0)
    model = DDP(IncidentAwareForecaster())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    bs, t0 = 16, time.time()
    for step in range(150):
        i = (step * bs) % len(x)
        xb, rb, yb = x[i : i + bs], rep[i : i + bs], y[i : i + bs]
        loss = F.mse_loss(model(xb, rb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(
                f"rank {rank} step {step} loss {loss.item():.4f} incidents {int(rb[:, 0].sum())} "
                f"t={time.time() - t0:.1f}s",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
