"""Next-hour temperature forecasting from automatic weather-station reports.

A small MLP predicts the next-hour temperature from the last 6 hourly observations
(temperature, dew point, pressure, wind) of a station. Raw reports arrive as METAR-like text
records and are parsed lazily in the Dataset's __getitem__. Stations are split across ranks by
station id. One of rank 1's stations (a mountain site) reports "M" (missing) for pressure during
an outage; the parser calls float() on every field without handling the missing-value marker.

Root cause: parse_record() does float(field) with no handling of the "M" missing-value code;
the first batch that contains the outage record (rank 1, step 34) raises ValueError on rank 1.
Plain run (measured): rank 1 dies with "ValueError: could not convert string to float: 'M'" in
parse_record() at step 34 (rank 0 last logged step 30 and then fails in
loss.backward() with a gloo connection error); torchrun exits 1 after ~5-8 s.
Fix: handle missing values in the parser (treat "M" as NaN and impute/skip the record, or filter
bad records when building the shard), e.g. try/except around float() with a fallback.
"""

import math
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

EXPECT = {
    "kind": ["rank_failure"],
    "rank": 1,
    "fix": [
        "missing",
        '"m"',
        "nan",
        "impute",
        "skip",
        "filter",
        "validate",
        "try",
        "except",
        "parse",
        "parser",
        "bad record",
        "malformed",
        "float",
        "clean",
    ],
    "options": [],
}

HIST = 6


def synth_station_reports(station_id, n_hours, seed, outage_at=None):
    rng = random.Random(seed)
    base_t = rng.uniform(-5, 25)
    recs = []
    for h in range(n_hours):
        t = base_t + 8 * math.sin(2 * 3.14159 * h / 24) + rng.gauss(0, 0.8)
        td = t - rng.uniform(1, 8)
        p = 1013 + rng.gauss(0, 4)
        w = abs(rng.gauss(4, 2))
        p_txt = "M" if outage_at is not None and outage_at <= h < outage_at + 3 else f"{p:.1f}"
        recs.append(f"{station_id} {h:05d} T{t:.1f} D{td:.1f} P{p_txt} W{w:.1f}")
    return recs


def parse_record(rec):
    sid, hour, *fields = rec.split()
    return [float(f[1:]) for f in fields]  # zoo: place


class StationWindows(Dataset):
    def __init__(self, stations):
        self.items = []
        for recs in stations:
            for start in range(len(recs) - HIST):
                self.items.append((recs, start))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        recs, start = self.items[i]
        obs = torch.tensor([parse_record(r) for r in recs[start : start + HIST + 1]])
        obs[:, 2] = (obs[:, 2] - 1013) / 10
        x = obs[:HIST].flatten() / 10
        y = obs[HIST, 0] / 10
        return x, y


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    station_ids = [f"ST{k:03d}" for k in range(8)]
    mine = station_ids[rank::world]
    stations = []
    for sid in mine:
        outage = 150 if sid == "ST005" else None  # alpine station, pressure sensor outage
        stations.append(synth_station_reports(sid, 200, seed=int(sid[2:]), outage_at=outage))
    ds = StationWindows(stations)
    loader = DataLoader(ds, batch_size=16, shuffle=False)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(HIST * 4, 64), nn.Tanh(), nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    step = 0
    for epoch in range(2):
        for x, y in loader:
            step += 1
            loss = F.mse_loss(model(x).squeeze(-1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 10 == 0 and rank == 0:
                print(f"epoch {epoch} step {step} mse {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
