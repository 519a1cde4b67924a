"""Telecom subscriber churn prediction, trained in two stages.

Stage 1 trains a tabular MLP (categorical embeddings + numeric usage features) on last
quarter's subscribers and checkpoints model and AdamW state from rank 0. Stage 2
resumes from that checkpoint and continues on the current quarter. To avoid every
worker hitting the shared file system, only rank 0 reads the checkpoint in
`restore_from()`; the weights then reach the other ranks through DDP's constructor
broadcast.

Root cause: the optimizer state (AdamW moments and step counts) is also restored only
on rank 0, and DDP broadcasts parameters and buffers, never optimizer state. Rank 0
resumes with warm moments and step=N, the other rank starts Adam from scratch, so the
same all-reduced gradients produce different updates and the weights diverge. Exit 0.

Fix: load the optimizer state on every rank (torch.load with map_location on all
ranks after a barrier), or broadcast the optimizer state from rank 0.

Observed (plain run): exit 0 in ~6 s; BCE for both stages printed by rank 0, "resumed
from epoch 3, done". Checked separately: after stage 2 the AdamW step count is 138 on rank 0
and 69 on rank 1 (every parameter's state), exp_avg / exp_avg_sq differ, and the model
weights differ between the ranks by up to ~4.7e-2.
"""
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": ["optimizer_state_behind", "weights_diverged", "model_differs"], "rank": 0,
          "fix": ["every rank", "all ranks", "broadcast", "map_location"],
          "options": []}

N_NUM = 10
CARDINALITIES = [4, 3, 12, 6]  # contract type, payment method, region, handset tier
CKPT = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "telcochurn_heldout29_stage1.pt")


def synth_subscribers(n, seed, drift=0.0):
    g = torch.Generator().manual_seed(seed)
    cats = torch.stack([torch.randint(0, c, (n,), generator=g) for c in CARDINALITIES], dim=1)
    num = torch.randn(n, N_NUM, generator=g)
    num[:, 0] = num[:, 0].abs() * 24 + 1           # tenure (months)
    num[:, 1] = 30 + 40 * torch.rand(n, generator=g)  # monthly charge
    logit = (-0.08 * num[:, 0] + 0.04 * num[:, 1] + 1.2 * (cats[:, 0] == 0).float()
             - 0.6 * (cats[:, 1] == 2).float() + 0.5 * num[:, 4] + drift - 0.8)
    churn = torch.bernoulli(torch.sigmoid(logit), generator=g)
    num[:, 0] = torch.log1p(num[:, 0])
    num[:, 1] = (num[:, 1] - 50) / 12
    return cats, num, churn


class ChurnMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, 4) for c in CARDINALITIES])
        self.mlp = nn.Sequential(nn.Linear(4 * len(CARDINALITIES) + N_NUM, 64), nn.ReLU(),
                                 nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, cats, num):
        e = torch.cat([emb(cats[:, i]) for i, emb in enumerate(self.embs)], dim=1)
        return self.mlp(torch.cat([e, num], dim=1)).squeeze(1)


def make_loader(cats, num, y, seed):
    ds = TensorDataset(cats, num, y)
    sampler = DistributedSampler(ds, shuffle=True, seed=seed)
    return DataLoader(ds, batch_size=64, sampler=sampler, drop_last=True), sampler


def run_epochs(model, optimizer, loader, sampler, epochs, tag):
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        tot = torch.zeros(2)
        for c, x, y in loader:
            loss = F.binary_cross_entropy_with_logits(model(c, x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tot += torch.tensor([loss.item() * len(y), len(y)])
        dist.all_reduce(tot)
        if dist.get_rank() == 0:
            print(f"[{tag}] epoch {epoch}: bce {tot[0] / tot[1]:.4f}", flush=True)


def build():
    torch.manual_seed(123)
    model = ChurnMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-3)
    return model, optimizer


def restore_from(path, model, optimizer):
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # zoo: place
    return state["epoch"]


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.makedirs(os.path.dirname(CKPT), exist_ok=True)

    # stage 1: last quarter
    model, optimizer = build()
    ddp = DDP(model)
    loader, sampler = make_loader(*synth_subscribers(3000, seed=1), seed=1)
    run_epochs(ddp, optimizer, loader, sampler, epochs=3, tag="Q3")
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, CKPT)
    dist.barrier()
    del ddp, model, optimizer

    # stage 2: resume on the current quarter
    model, optimizer = build()
    start_epoch = 0
    if rank == 0:
        start_epoch = restore_from(CKPT, model, optimizer)
    ddp = DDP(model)
    loader, sampler = make_loader(*synth_subscribers(3000, seed=2, drift=0.3), seed=2)
    run_epochs(ddp, optimizer, loader, sampler, epochs=3, tag="Q4")
    if rank == 0:
        print(f"resumed from epoch {start_epoch}, done", flush=True)

    dist.barrier()
    del ddp, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
