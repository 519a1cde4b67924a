"""Consumer-loan default scoring (probability of default), DDP on CPU.

What the job does
    Trains an MLP on 40 bureau/application features with a DistributedSampler.
    Every EVAL_EVERY optimizer steps the main process scores the whole
    out-of-time portfolio (200k loans), computes AUC and KS for the risk team's
    dashboard and writes a checkpoint, using the unwrapped model so no
    collective is involved.

Root cause
    The portfolio evaluation runs on rank 0 only, inside the training loop, and
    takes far longer than a training step (scoring 200k rows + sorting for AUC +
    checkpoint). Rank 1 sits in the next gradient all-reduce until rank 0
    returns, every EVAL_EVERY steps; most of the run's wall time is rank 1
    waiting on rank 0's periodic work.

Fix
    Shard the evaluation across all ranks (each scores 1/world of the portfolio,
    then gather/all_reduce the statistics), run it less often or on a
    subsample, or move it out of the training loop (async / separate process).

Observed (plain run)
    rc 0 in ~9 s. Rank 0 prints "[oot] step 25 auc 0.8760 ks 0.5847 ..." every
    25 steps (10 times, steps 25..250) and "trained 250 steps in 4.0s". Timed
    alone, one portfolio_eval takes ~0.34 s and one training step ~1.3 ms, so
    ~3.4 s of the 4.0 s loop is rank 0's evaluation while rank 1 waits in the
    next step's gradient all-reduce.
"""
import gc
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = {
    "kind": ["periodic_rank_work", "rank_only_eval", "rank_only_work", "awaited_work"],
    "rank": 0,
    "fix": ["all ranks", "every rank", "shard", "less often", "subsample", "async", "background"],
    "options": [],
}

N_FEATURES = 40
CONFIG = {
    "train_rows": 64_000,
    "oot_rows": 200_000,
    "batch_size": 256,
    "lr": 1e-3,
    "epochs": 2,
    "eval_every": 25,
    "seed": 17,
}


def make_loans(n, seed, drift=0.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, N_FEATURES)).astype(np.float32)
    x[:, :5] += drift
    w = np.random.default_rng(99).normal(scale=0.4, size=N_FEATURES)
    logit = x @ w + 0.8 * np.tanh(x[:, 0] * x[:, 1]) - 2.2
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y)


class PDModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(N_FEATURES, 256), nn.ReLU(),
            nn.Linear(256, 128), nn.ReLU(),
            nn.Linear(128, 1),
        )

    def forward(self, x):
        return self.mlp(x).squeeze(-1)


def auc_ks(scores, labels):
    order = np.argsort(scores)
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    auc = (ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
    sorted_pos = pos[order[::-1]]
    ks = np.max(np.abs(np.cumsum(sorted_pos) / n_pos - np.cumsum(~sorted_pos) / n_neg))
    return float(auc), float(ks)


@torch.no_grad()
def portfolio_eval(net, x, y, step, out_dir):
    net.eval()
    scores = torch.cat([torch.sigmoid(net(x[i:i + 10_000])) for i in range(0, len(x), 10_000)])
    net.train()
    auc, ks = auc_ks(scores.numpy(), y.numpy())
    torch.save({"step": step, "model": net.state_dict()}, os.path.join(out_dir, "pd_latest.pt"))
    print(f"[oot] step {step} auc {auc:.4f} ks {ks:.4f} mean_pd {scores.mean():.4f}", flush=True)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    is_main = rank == 0
    torch.manual_seed(CONFIG["seed"])
    out_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "loan_pd")
    os.makedirs(out_dir, exist_ok=True)

    x_tr, y_tr = make_loans(CONFIG["train_rows"], seed=1)
    train = TensorDataset(x_tr, y_tr)
    sampler = DistributedSampler(train, shuffle=True, seed=CONFIG["seed"])
    loader = DataLoader(train, batch_size=CONFIG["batch_size"], sampler=sampler, drop_last=True)
    if is_main:
        x_oot, y_oot = make_loans(CONFIG["oot_rows"], seed=2, drift=0.15)

    model = DDP(PDModel())
    opt = torch.optim.Adam(model.parameters(), lr=CONFIG["lr"])
    pos_weight = torch.tensor(4.0)

    global_step = 0
    t0 = time.time()
    for epoch in range(CONFIG["epochs"]):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.binary_cross_entropy_with_logits(model(xb), yb, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            global_step += 1
            if is_main and global_step % CONFIG["eval_every"] == 0:
                portfolio_eval(model.module, x_oot, y_oot, global_step, out_dir)  # zoo: place

    if is_main:
        print(f"trained {global_step} steps in {time.time() - t0:.1f}s", flush=True)
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
