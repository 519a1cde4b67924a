"""Source-code defect prediction.

A small convolutional token model reads tokenised functions (variable length, padded)
and predicts whether the function later received a bug-fix commit. Training uses SGD
with momentum and a "token-proportional" learning-rate rule: the step size follows the
number of real (non-padding) tokens in the batch, with a linear warmup.

Root cause: `TokenProportionalLR.step()` is fed the number of non-padding tokens in
the rank's *own* batch. Every rank sees a different batch, so every rank computes a
different learning rate and applies it to the same all-reduced gradient. The replicas
drift apart from the first step on; nothing raises.

Fix: all_reduce the token count (SUM, then divide by the world size) before computing
the learning rate, so every rank uses the same global value.

Observed (plain run, 2 ranks, gloo/CPU): exit 0 in ~6 s; only rank 0's loss/lr lines are
printed, nothing unusual. Checked separately (per-rank parameter comparison at exit): every
parameter tensor differs between the ranks, max |diff| vs rank 0 ~1.2e-2 (out.2.weight),
~2e-3 on the conv weight; the last learning rate differs by ~7e-3 and the SGD momentum
buffers differ as well.
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

EXPECT = {"kind": ["weights_diverged", "model_differs"], "rank": None,
          "fix": ["all_reduce", "global token count", "same learning rate", "every rank"],
          "options": []}

CFG = dict(vocab=600, max_len=96, emb=32, channels=64, batch_size=32, epochs=5,
           base_lr=0.05, ref_tokens=32 * 48, warmup_steps=20, seed=7)
PAD = 0


def synth_functions(n, seed):
    """Token ids of synthetic functions; risky API tokens raise the defect odds."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, CFG["max_len"] + 1, (n,), generator=g)
    tokens = torch.randint(1, CFG["vocab"], (n, CFG["max_len"]), generator=g)
    mask = torch.arange(CFG["max_len"])[None, :] < lengths[:, None]
    tokens = tokens * mask
    risky = ((tokens >= CFG["vocab"] - 50) & mask).sum(1).float() / lengths.float()
    nesting = (lengths.float() / CFG["max_len"])
    logit = 60.0 * (risky - 0.08) + 2.0 * (nesting - 0.5)
    labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
    return tokens, labels


class DefectNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(CFG["vocab"], CFG["emb"], padding_idx=PAD)
        self.conv = nn.Conv1d(CFG["emb"], CFG["channels"], kernel_size=5, padding=2)
        self.out = nn.Sequential(nn.Linear(2 * CFG["channels"], 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, tokens):
        mask = (tokens != PAD).unsqueeze(1).float()
        h = self.conv(self.emb(tokens).transpose(1, 2)).relu() * mask
        pooled = torch.cat([h.sum(2) / mask.sum(2).clamp_min(1.0), h.amax(dim=2)], dim=1)
        return self.out(pooled).squeeze(1)


class TokenProportionalLR:
    """lr = base_lr * warmup(step) * tokens_in_batch / ref_tokens."""

    def __init__(self, optimizer, base_lr, ref_tokens, warmup_steps):
        self.optimizer = optimizer
        self.base_lr = base_lr
        self.ref_tokens = ref_tokens
        self.warmup_steps = warmup_steps
        self.step_num = 0

    def step(self, n_tokens):
        self.step_num += 1
        warm = min(1.0, self.step_num / self.warmup_steps)
        lr = self.base_lr * warm * float(n_tokens) / self.ref_tokens  # zoo: place
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(CFG["seed"])

    tokens, labels = synth_functions(2048, seed=CFG["seed"])
    ds = TensorDataset(tokens, labels)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=CFG["seed"])
    loader = DataLoader(ds, batch_size=CFG["batch_size"], sampler=sampler, drop_last=True)

    model = DDP(DefectNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=CFG["base_lr"], momentum=0.9, weight_decay=1e-4)
    schedule = TokenProportionalLR(optimizer, CFG["base_lr"], CFG["ref_tokens"], CFG["warmup_steps"])

    log_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, "codedefect_heldout29_metrics.tsv")

    rows = []
    for epoch in range(CFG["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        total, seen = 0.0, 0
        for tok, y in loader:
            n_tokens = (tok != PAD).sum()
            lr = schedule.step(n_tokens)
            logits = model(tok)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * y.numel()
            seen += y.numel()
        stats = torch.tensor([total, float(seen)])
        dist.all_reduce(stats)
        mean_loss = (stats[0] / stats[1]).item()
        rows.append(f"{epoch}\t{mean_loss:.4f}\t{lr:.5f}")
        if rank == 0:
            print(f"epoch {epoch}: train bce {mean_loss:.4f} (last lr {lr:.4f})", flush=True)

    if rank == 0:
        with open(log_path, "w") as fh:
            fh.write("epoch\tloss\tlr\n" + "\n".join(rows) + "\n")
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
