"""Healthy twin: gradual unfreezing done right (re-wrap in DDP), plus a rank-0 eval done right.

Story: a tabular churn model: a "pretrained" feature encoder (same seed on every rank) and a
new head.  Epoch 0 trains only the head (the encoder is frozen before wrapping).  At epoch 1
the trainer unfreezes the encoder and, knowing that DDP fixes its gradient buckets at
construction, builds a new wrapper around the same module (`DDP(model.module)`), whose
constructor broadcasts rank 0's state and registers every parameter that now requires grad,
and a new optimizer with two parameter groups.  After each epoch rank 0 alone scores a small
held-out set through `model.module` under `torch.no_grad()` (no collective, about a
millisecond) and prints it; the others go straight on, and nothing waits on rank 0.

Root cause: none (healthy).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = None

FEATURES = 20


def customers(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.linspace(-1, 1, FEATURES)
    churn = ((x @ w + 0.5 * x[:, 0] * x[:, 1] + 0.3 * torch.randn(n, generator=g)) > 0.4).float()
    return x, churn


class ChurnModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU())
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).squeeze(-1)


def set_trainable(module, flag):
    for p in module.parameters():
        p.requires_grad_(flag)


@torch.no_grad()
def holdout_auc_proxy(net, x, y):
    net.eval()
    p = torch.sigmoid(net(x))
    net.train()
    return ((p > 0.5).float() == y).float().mean().item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = ChurnModel()
    set_trainable(net.encoder, False)
    model = DDP(net)
    opt = torch.optim.Adam(net.head.parameters(), lr=3e-3)

    x, y = customers(4096, seed=1)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=True, seed=2)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    val_x, val_y = customers(256, seed=99)

    for epoch in range(4):
        if epoch == 1:
            set_trainable(net.encoder, True)
            model = DDP(model.module)  # new buckets: the encoder is trainable now
            opt = torch.optim.Adam([{"params": net.head.parameters(), "lr": 3e-3},
                                    {"params": net.encoder.parameters(), "lr": 5e-4}])
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.binary_cross_entropy_with_logits(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            acc = holdout_auc_proxy(model.module, val_x, val_y)
            print(f"epoch {epoch}: loss {loss.item():.4f} holdout acc {acc:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
