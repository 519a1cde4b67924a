"""Rank 1 gets every night session, and night sessions are median-filtered on load -> straggler.

Story: a bearing-fault classifier for vibration sensors on a conveyor line.  The recording
sessions are listed in time order and each rank takes a contiguous half of the list
(`sessions[rank * half:(rank + 1) * half]`), a sharding that looks balanced: same number of
sessions, same number of clips.  But the list is sorted by start time, so rank 1 receives all
the night-shift sessions, and night sessions are flagged `noisy` (the line's ventilation
runs at night): `VibrationClips.__getitem__` runs `median_denoise` (four passes of a 17-tap
median filter) on every one of them, in the main process (num_workers=0).  Rank 1 spends
40-50 ms loading each batch (rank 0: 2-3 ms), more than half its compute time; rank 0
waits for it in every gradient all-reduce, 96 steps long.

Root cause: rank 1, slow in data loading (DataLoader wait) on every step.
Fix: interleave the sessions across ranks (a shuffled/strided shard or DistributedSampler
over all clips) so each rank gets its share of noisy ones, denoise once offline and cache,
or move the filtering into DataLoader workers (num_workers > 0).
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["straggler"],
    "rank": 1,
    "fix": ["interleav", "shuffle", "shard", "balance", "DistributedSampler", "sampler",
            "num_workers", "worker", "cache", "offline", "precompute", "denoise", "data"],
    "names": [["data_wait", "data wait", "data loading", "DataLoader", "loader"]],
    "options": [],
}

N_SESSIONS = 32
CLIPS_PER_SESSION = 48
LENGTH = 1024
CLASSES = ("healthy", "inner_race", "outer_race", "ball")


def list_sessions():
    """(session id, start hour, noisy) in time order, as the recording index stores them."""
    sessions = []
    for s in range(N_SESSIONS):
        hour = 6 + s * 0.5  # 06:00 .. 21:30
        sessions.append((s, hour, hour >= 14.0))
    return sessions


def median_denoise(sig, width=17, passes=4):
    pad = width // 2
    for _ in range(passes):
        sig = F.pad(sig[None, None], (pad, pad), mode="reflect")[0, 0]
        sig = sig.unfold(0, width, 1).median(-1).values
    return sig


class VibrationClips(Dataset):
    def __init__(self, sessions):
        self.index = [(s, noisy, c) for s, _, noisy in sessions for c in range(CLIPS_PER_SESSION)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        session, noisy, clip = self.index[i]
        g = torch.Generator().manual_seed(session * 1000 + clip)
        label = int(torch.randint(0, len(CLASSES), (1,), generator=g))
        t = torch.arange(LENGTH) / 2048.0
        sig = torch.sin(2 * math.pi * 50 * t)
        if label:
            sig = sig + 0.6 * torch.sin(2 * math.pi * (120 + 70 * label) * t) * (torch.sin(2 * math.pi * 7 * t) > 0.7)
        sig = sig + 0.2 * torch.randn(LENGTH, generator=g)
        if noisy:
            sig = sig + 0.8 * (torch.rand(LENGTH, generator=g) < 0.03) * torch.randn(LENGTH, generator=g) * 5
            sig = median_denoise(sig)
        return sig, label


class BearingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, 32, 9, stride=2), nn.ReLU(),
            nn.Conv1d(32, 64, 9, stride=2), nn.ReLU(),
            nn.Conv1d(64, 64, 9, stride=2), nn.ReLU(),
        )
        self.classifier = nn.Linear(64, len(CLASSES))

    def forward(self, x):
        return self.classifier(self.features(x.unsqueeze(1)).mean(-1))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sessions = list_sessions()
    half = len(sessions) // world
    mine = sessions[rank * half:(rank + 1) * half]
    loader = DataLoader(VibrationClips(mine), batch_size=32, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(rank))

    torch.manual_seed(0)
    model = DDP(BearingNet())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(4):
        running = 0.0
        for step, (x, y) in enumerate(loader):  # noqa: B007 (read after the loop)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += loss.item()
        if rank == 0:
            print(f"epoch {epoch}: loss {running / (step + 1):.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
