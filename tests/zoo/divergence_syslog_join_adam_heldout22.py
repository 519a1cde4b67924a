"""Anomaly detection on server syslog lines with an autoencoder, one log shard per rank.

Each rank reads the logs of one data centre (synthetic template-based syslog lines hashed
into bag-of-token vectors). The two data centres produced different amounts of logs, so the
ranks see a different number of batches per epoch -- 1500 vs 1850 lines. The training loop
is wrapped in the torch.distributed.algorithms.Join context manager, which shadows the
gradient all-reduces of the rank that runs out of data first, and the job finishes cleanly.

Written as a healthy twin (held-out set 22), it is not one: Join re-syncs the weights at its
exit, but not Adam's state. Rank 0 ran 47 steps an epoch and shadowed rank 1's other 11 without
stepping, so its moments and step count fall behind, and in the second epoch the same averaged
gradients move the replicas apart (parameter checksums at that epoch's first step: 15.1026 on
rank 0, 15.1537 on rank 1; at its 40th: 13.868 and 14.565). With plain SGD they stay equal.

Root cause: rank 0 (it joined early, and its Adam state fell behind under Join).
Fix: shard so every rank gets the same number of batches (DistributedSampler), or keep the
optimizer state in step after each Join (broadcast it), or use an optimizer without state.
"""

import random
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": ["weights_diverged", "optimizer_state_behind"],
    "rank": 0,
    "fix": ["Join", "join", "optimizer state", "same number of batches", "DistributedSampler", "SGD"],
    "options": [],
}

N_HASH = 128
TEMPLATES = [
    "sshd accepted publickey for {user} from {ip} port {port}",
    "kernel eth0 link up 10000 mbps full duplex",
    "cron ({user}) cmd run-parts /etc/cron.hourly",
    "systemd started session {port} of user {user}",
    "nginx {ip} get /api/v1/items {code}",
    "postgres checkpoint complete wrote {port} buffers",
]
ANOMALIES = ["kernel oom-killer invoked killed process {port}", "sshd failed password for root from {ip}"]


def synth_syslog(n, seed):
    rng = random.Random(seed)
    lines, is_anom = [], []
    for _ in range(n):
        anom = rng.random() < 0.03
        tpl = rng.choice(ANOMALIES if anom else TEMPLATES)
        lines.append(
            tpl.format(
                user=rng.choice(["alice", "bob", "deploy", "backup"]),
                ip=f"10.0.{rng.randrange(8)}.{rng.randrange(255)}",
                port=rng.randrange(1000, 9000),
                code=rng.choice([200, 200, 304, 404]),
            )
        )
        is_anom.append(anom)
    return lines, torch.tensor(is_anom)


def featurise(lines):
    x = torch.zeros(len(lines), N_HASH)
    for i, line in enumerate(lines):
        for tok in line.split():
            if not any(c.isdigit() for c in tok):
                x[i, zlib.crc32(tok.encode()) % N_HASH] += 1.0
    return x / x.sum(1, keepdim=True).clamp(min=1)


class LogAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(N_HASH, 32), nn.ReLU(), nn.Linear(32, 8))
        self.dec = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, N_HASH))

    def forward(self, x):
        return self.dec(self.enc(x))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n_lines = 1500 if rank == 0 else 1850
    lines, anom = synth_syslog(n_lines, seed=31 + rank)
    x = featurise(lines)
    loader = DataLoader(
        TensorDataset(x), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(rank)
    )
    torch.manual_seed(0)
    model = DDP(LogAE())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(2):
        steps = 0
        with Join([model]):
            for (xb,) in loader:
                loss = F.mse_loss(model(xb), xb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                steps += 1
        print(f"rank {rank} epoch {epoch}: {steps} steps, last loss {loss.item():.5f}", flush=True)
    with torch.no_grad():
        err = ((model.module(x) - x) ** 2).sum(1)
        top = err.topk(int(anom.sum())).indices
        precision = anom[top].float().mean().item()
    stats = torch.tensor([precision])
    dist.all_reduce(stats)
    if rank == 0:
        print(f"mean precision@k of anomaly ranking: {stats.item() / world:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
