"""30-day hospital readmission risk model trained with DDP.

Story
-----
Tabular model over discharge summaries: numeric vitals/labs (standardised) plus categorical
codes (admission type, discharge disposition, primary diagnosis group) through embeddings,
then a residual MLP that outputs a readmission logit.  Training uses a DistributedSampler.
Validation is sharded by hand (`val_idx[rank::world]`) and, because AUROC cannot be averaged
across shards, every rank all_gathers its predicted probabilities so that rank 0 can compute
the global AUROC.

Root cause
----------
The validation cohort has 1001 patients, so rank 0 scores 501 patients and rank 1 scores 500.
`gather_predictions()` allocates the receive buffers with `torch.empty_like(local)` and calls
`dist.all_gather`, i.e. each rank assumes every rank contributes a tensor of its own length:
the all_gather's shapes differ between ranks (501 vs 500 elements).
Fix: pad the local predictions to a common length (all_reduce the max length first and send the
true count along), or use all_gather_object / a DistributedSampler that pads the shards.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): exit code 1 after ~5-6 s,
in the first validation.  Rank 1 aborts (SIGABRT, exitcode -6) with gloo's
"enforce fail ... pair.cc:456] op.preamble.length <= op.nbytes. 1002 vs 1000. Received data size
doesn't match expected size. Is there a distributed collective mismatch in your code?" (no Python
traceback on rank 1); rank 0 raises RuntimeError "Connection reset by peer" from the all_gather
in gather_predictions() and is SIGTERMed by torchrun.
"""
import logging
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": ["collective_mismatch", "rank_failure", "hang"],
    "rank": None,
    "fix": ["all_gather", "pad", "shape"],
    "options": [],
}

N_TRAIN, N_VAL = 6000, 1001
N_NUM = 14
CARDS = {"adm_type": 8, "disposition": 12, "dx_group": 40}
EPOCHS = 3
BATCH = 128
SEED = 7

log = logging.getLogger("readmit")


def synth_cohort(n, seed):
    g = torch.Generator().manual_seed(seed)
    num = torch.randn(n, N_NUM, generator=g)
    cats = torch.stack([torch.randint(0, c, (n,), generator=g) for c in CARDS.values()], 1)
    dx_risk = torch.linspace(-1.0, 1.5, CARDS["dx_group"])[cats[:, 2]]
    disp_risk = (cats[:, 1] >= 9).float() * 0.8
    score = 0.9 * num[:, 0] - 0.6 * num[:, 3] + 0.4 * num[:, 5] * num[:, 6] + dx_risk + disp_risk
    p = torch.sigmoid(score - 1.2)
    y = (torch.rand(n, generator=g) < p).float()
    return num, cats, y


class ResidualMLP(nn.Module):
    def __init__(self, dim, p=0.1):
        super().__init__()
        self.ff = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * 2), nn.GELU(),
                                nn.Dropout(p), nn.Linear(dim * 2, dim))

    def forward(self, x):
        return x + self.ff(x)


class ReadmissionNet(nn.Module):
    def __init__(self, emb_dim=8, hidden=64):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, emb_dim) for c in CARDS.values()])
        self.inp = nn.Linear(N_NUM + emb_dim * len(CARDS), hidden)
        self.body = nn.Sequential(ResidualMLP(hidden), ResidualMLP(hidden))
        self.out = nn.Linear(hidden, 1)

    def forward(self, num, cats):
        e = [emb(cats[:, i]) for i, emb in enumerate(self.embs)]
        h = self.inp(torch.cat([num] + e, 1))
        return self.out(self.body(h)).squeeze(1)


def auroc(scores, labels):
    order = torch.argsort(scores, descending=True)
    y = labels[order]
    tps, fps = torch.cumsum(y, 0), torch.cumsum(1 - y, 0)
    tpr, fpr = tps / tps[-1].clamp(min=1), fps / fps[-1].clamp(min=1)
    return torch.trapz(tpr, fpr).item()


def gather_predictions(local):
    bufs = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, local)  # zoo: place
    return torch.cat(bufs)


@torch.no_grad()
def validate(model, num, cats, y):
    model.eval()
    probs = torch.sigmoid(model.module(num, cats))
    nll = F.binary_cross_entropy(probs, y, reduction="sum")
    model.train()
    all_p = gather_predictions(probs)
    all_y = gather_predictions(y)
    tot = torch.tensor([nll.item(), float(len(y))])
    dist.all_reduce(tot)
    return tot[0].item() / tot[1].item(), auroc(all_p, all_y)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED)

    tr_num, tr_cat, tr_y = synth_cohort(N_TRAIN, SEED)
    va_num, va_cat, va_y = synth_cohort(N_VAL, SEED + 100)
    mu, sd = tr_num.mean(0), tr_num.std(0)
    tr_num, va_num = (tr_num - mu) / sd, (va_num - mu) / sd

    train_ds = TensorDataset(tr_num, tr_cat, tr_y)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(train_ds, batch_size=BATCH, sampler=sampler)
    val_idx = torch.arange(N_VAL)[rank::world]
    va_num, va_cat, va_y = va_num[val_idx], va_cat[val_idx], va_y[val_idx]
    log.info("train shard %d rows, validation shard %d rows", len(sampler), len(val_idx))

    model = DDP(ReadmissionNet())
    pos_weight = (1 - tr_y.mean()) / tr_y.mean()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS * len(loader))
    ckpt_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "readmit_ho24")
    os.makedirs(ckpt_dir, exist_ok=True)
    best_auc = 0.0

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        t0, total = time.time(), 0.0
        for num, cats, y in loader:
            logit = model(num, cats)
            loss = F.binary_cross_entropy_with_logits(logit, y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            total += loss.item()
        val_nll, val_auc = validate(model, va_num, va_cat, va_y)
        if rank == 0:
            log.info("epoch %d loss %.4f val_nll %.4f auroc %.4f (%.1fs)", epoch,
                     total / len(loader), val_nll, val_auc, time.time() - t0)
            if val_auc > best_auc:
                best_auc = val_auc
                torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "best.pt"))

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] param checksum {checksum:.10f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
