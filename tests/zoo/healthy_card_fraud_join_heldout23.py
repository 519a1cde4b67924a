"""Card-transaction fraud detection with uneven per-rank shards (healthy).

An MLP scores card transactions (amount, merchant category, hour, distance from home,
card-present flag, velocity features) for fraud. Transactions are sharded by issuing bank, so
rank 0 gets 4800 rows and rank 1 only 3400 -- the classic uneven-inputs setup that hangs a DDP
job when the short rank leaves the loop. Here the training loop runs inside
torch.distributed.algorithms.join.Join([model]): when rank 1 runs out of batches it "joins" and
shadows rank 0's remaining gradient all-reduces with zeros, and at the end DDP broadcasts the
final model from the last rank to join, so both ranks finish with identical weights. The
optimizer is plain SGD without momentum or weight decay (no per-rank optimizer state that
could drift while one rank is joined).

Root cause: none (healthy job).
Plain run (measured): exits 0 in ~5 s; rank 0 ran 192 local steps, rank 1 136 (joined early);
parameter checksums rank 0 288.265572 == rank 1 288.265572.
Fix: nothing to fix.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None

N_MCC = 12


def synth_transactions(n, seed):
    g = torch.Generator().manual_seed(seed)
    amount = torch.exp(torch.randn(n, generator=g) * 1.0 + 3.5)
    mcc = torch.randint(0, N_MCC, (n,), generator=g)
    hour = torch.randint(0, 24, (n,), generator=g)
    dist_home = torch.exp(torch.randn(n, generator=g) * 1.2 + 1.0)
    present = (torch.rand(n, generator=g) < 0.6).float()
    velocity = torch.poisson(torch.full((n,), 1.5), generator=g)
    night = ((hour < 5) | (hour > 22)).float()
    logit = (
        -4.0
        + 0.8 * torch.log(amount / 30)
        + 0.9 * night
        + 0.5 * torch.log1p(dist_home)
        - 1.5 * present
        + 0.6 * velocity
    )
    logit = logit + 1.2 * (mcc == 7).float()
    y = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    x = torch.cat(
        [
            torch.stack(
                [
                    torch.log1p(amount) / 6,
                    hour / 24,
                    torch.log1p(dist_home) / 4,
                    present,
                    velocity / 5,
                    night,
                ],
                1,
            ),
            F.one_hot(mcc, N_MCC).float(),
        ],
        1,
    )
    return x, y


def param_checksum(model):
    return sum(p.detach().double().abs().sum().item() for p in model.parameters())


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n_rows = {0: 4800, 1: 3400}[rank]  # issuing-bank shards are not the same size
    x, y = synth_transactions(n_rows, seed=70 + rank)
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(6 + N_MCC, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pos_weight = torch.tensor(8.0)
    bs, steps = 50, 0
    with Join([model]):
        for epoch in range(2):
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch * 10 + rank))
            for k in range(0, len(x) - bs + 1, bs):
                idx = perm[k : k + bs]
                logits = model(x[idx]).squeeze(-1)
                loss = F.binary_cross_entropy_with_logits(logits, y[idx], pos_weight=pos_weight)
                opt.zero_grad()
                loss.backward()
                opt.step()
                steps += 1
                if steps % 40 == 0:
                    print(f"rank {rank} epoch {epoch} step {steps} loss {loss.item():.4f}", flush=True)
    print(
        f"rank {rank} finished after {steps} local steps; param checksum {param_checksum(model):.6f}",
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
