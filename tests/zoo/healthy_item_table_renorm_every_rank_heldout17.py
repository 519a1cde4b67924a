"""Healthy twin of the max_norm session recommender: the item embedding has no max_norm;
instead, after every optimizer step, every rank renormalises the *whole* table in place
(rows capped at norm 1.0) under torch.no_grad.  The change is made after wrapping, in place,
outside autograd -- but it is the same deterministic operation on identical weights on every
rank, so the replicas stay bit-for-bit equal.  Rank 0 prints a cheap line (loss, mean row
norm) every 100 steps.

Near-misses a diagnosis should not flag: parameters modified in place after DDP construction
(identically on all ranks), cheap rank-0 logging, set_epoch called every epoch.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None

N_ITEMS = 6000
N_CATS = 40
SESSION_LEN = 20
BATCH = 32
EPOCHS = 10
MAX_ROW_NORM = 1.0


def make_sessions(n, seed):
    g = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, N_ITEMS + 1, dtype=torch.float) ** 0.8
    items = torch.multinomial(probs.expand(n, -1), SESSION_LEN, replacement=True, generator=g)
    nxt = torch.multinomial(probs, n, replacement=True, generator=g)
    return TensorDataset(items, nxt % N_CATS)


class SessionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(N_ITEMS, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, N_CATS))

    def forward(self, sessions):
        return self.mlp(self.items(sessions).mean(dim=1))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = make_sessions(4800, seed=7)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = DDP(SessionModel())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    table = model.module.items.weight

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for sessions, cats in loader:
            loss = F.cross_entropy(model(sessions), cats)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                table.renorm_(2, 0, MAX_ROW_NORM)  # same rows, same op, on every rank
            if rank == 0 and step % 100 == 0:
                norm = table.detach().norm(dim=1).mean().item()
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} row norm {norm:.3f}",
                      flush=True)
            step += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
