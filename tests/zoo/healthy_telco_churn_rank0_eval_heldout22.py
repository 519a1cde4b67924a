"""Customer-churn prediction for a telecom operator (tabular data).

An MLP with BatchNorm predicts whether a subscriber churns next month from synthetic billing
and usage features (tenure, monthly charge, dropped calls, support tickets, contract type).
Rank 0 alone evaluates on a hold-out set every 25 steps and prints AUC-like ranking accuracy;
the other rank waits at a barrier meanwhile. This looks like the classic "rank-0-only eval"
hang, but evaluation goes through model.module (no DDP collectives, no buffer broadcast) under
torch.no_grad(), and every rank calls the same barrier afterwards -- the job is correct.

Root cause: none (healthy job).
Fix: nothing to fix.
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None

N_FEAT = 10


def synth_subscribers(n, seed):
    g = torch.Generator().manual_seed(seed)
    tenure = torch.rand(n, generator=g) * 72
    charge = 20 + torch.rand(n, generator=g) * 100
    dropped = torch.poisson(torch.full((n,), 2.0), generator=g)
    tickets = torch.poisson(torch.full((n,), 0.7), generator=g)
    contract = torch.randint(0, 3, (n,), generator=g)
    x = torch.stack([tenure / 72, charge / 120, dropped / 10, tickets / 5], 1)
    x = torch.cat([x, F.one_hot(contract, 3).float(), torch.randn(n, 3, generator=g) * 0.1], 1)
    logit = (
        -1.0 - 2.5 * x[:, 0] + 1.5 * x[:, 1] + 2.0 * x[:, 2] + 1.5 * x[:, 3] + 1.2 * (contract == 0).float()
    )
    y = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    return x, y


class ChurnMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(N_FEAT, 64),
            nn.BatchNorm1d(64),
            nn.ReLU(),
            nn.Linear(64, 32),
            nn.BatchNorm1d(32),
            nn.ReLU(),
            nn.Linear(32, 1),
        )

    def forward(self, x):
        return self.net(x).squeeze(-1)


@torch.no_grad()
def ranking_accuracy(net, x, y):
    was_training = net.training
    net.eval()
    s = net(x)
    pos, neg = s[y == 1], s[y == 0]
    acc = (pos[:, None] > neg[None, :]).float().mean().item()
    net.train(was_training)
    return acc


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, y = synth_subscribers(6000, seed=1 + rank)
    torch.manual_seed(0)
    model = DDP(ChurnMLP())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    if rank == 0:
        xh, yh = synth_subscribers(1500, seed=999)
    bs, t0 = 64, time.time()
    for step in range(1, 101):
        i = (step * bs) % (len(x) - bs)
        loss = F.binary_cross_entropy_with_logits(model(x[i : i + bs]), y[i : i + bs])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0:
            if rank == 0:
                auc = ranking_accuracy(model.module, xh, yh)
                print(
                    f"step {step} loss {loss.item():.3f} holdout AUC {auc:.3f} t={time.time() - t0:.1f}s",
                    flush=True,
                )
            dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/ho22_churn_mlp.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
