"""Automated essay scoring (AES) with DDP.

What the job does
    Regresses a 1-6 holistic score from a hashed bag-of-words vector plus a
    log-length feature, for essays written to 8 prompts. Training shards with a
    DistributedSampler; validation has each rank score a contiguous slice of the
    held-out export (which is sorted by prompt), pools MAE with all_reduce, and
    reports the MAE on essays under the minimum word count through a helper.
    Rank 0 then writes a checkpoint and everyone meets at a barrier.

Root cause
    `short_essay_report` returns early when the local slice has no essays under
    MIN_WORDS, so its all_reduce is only issued by ranks that have short essays.
    Prompt 7 is a short-answer prompt and sits at the end of the sorted held-out
    file, so only rank 1's contiguous slice contains short essays: rank 1 enters
    the all_reduce, rank 0 skips it and enters the post-checkpoint barrier. The
    two collectives never match and the job hangs after epoch 0.

Fix
    Make the collective unconditional: always build the (sum, count) tensor
    (zeros when there are no short essays) and all_reduce it on every rank, then
    decide on the pooled count; or shard validation with a DistributedSampler.

Observed (plain run)
    `timeout 90 torchrun ...` -> rc 124 after 90 s (the job never ends by itself;
    torchrun is killed by the timeout's SIGTERM). About 3 s after launch rank 0
    prints its only line, "epoch 0 train_loss 0.4736 val_mae 0.783 (0.2s)", and
    nothing follows. A faulthandler dump taken 12 s in shows rank 1 blocked in
    dist.all_reduce inside short_essay_report (called from main after
    global_mae) and rank 0 blocked in the dist.barrier() after its checkpoint
    save. Both processes are idle and neither exits; no error text.
"""
import math
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
    "kind": ["hang", "rank_only_collective", "collective_mismatch"],
    "rank": 1,
    "fix": ["every rank", "all ranks", "unconditional", "early return", "always"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

VOCAB_BUCKETS = 512
N_PROMPTS = 8
SHORT_ANSWER_PROMPT = 7
MIN_WORDS = 80
EPOCHS = 4
BATCH = 32
LR = 2e-3


def synth_essays(n, seed):
    """Hashed term frequencies for n essays, sorted by prompt like the export."""
    rng = np.random.default_rng(seed)
    topic_rng = np.random.default_rng(2024)  # prompts share topics across splits
    topics = topic_rng.dirichlet(np.full(VOCAB_BUCKETS, 0.3), size=N_PROMPTS)
    rich_vocab = topic_rng.normal(size=VOCAB_BUCKETS)
    prompts = np.sort(rng.integers(0, N_PROMPTS, size=n))
    feats = np.zeros((n, VOCAB_BUCKETS + 1), dtype=np.float32)
    words = np.zeros(n, dtype=np.float32)
    scores = np.zeros(n, dtype=np.float32)
    for i, p in enumerate(prompts):
        w = rng.integers(25, 70) if p == SHORT_ANSWER_PROMPT else rng.integers(150, 400)
        skill = rng.normal()
        probs = topics[p] * np.exp(0.35 * skill * rich_vocab)
        probs /= probs.sum()
        counts = rng.multinomial(w, probs)
        feats[i, :VOCAB_BUCKETS] = counts / w
        feats[i, VOCAB_BUCKETS] = math.log(w) / 6.0
        raw = 3.5 + 1.1 * skill + 0.15 * rng.normal()
        scores[i] = float(np.clip(np.round(raw), 1, 6))
        words[i] = w
    return feats, scores, words


class Scorer(nn.Module):
    def __init__(self, d_in):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, 256), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(256, 64), nn.GELU(),
            nn.Linear(64, 1),
        )

    def forward(self, x):
        return 1.0 + 5.0 * torch.sigmoid(self.net(x).squeeze(-1))


def global_mae(preds, targets):
    stats = torch.stack([(preds - targets).abs().sum(), torch.tensor(float(len(targets)))])
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def short_essay_report(preds, targets, words):
    """MAE on essays under the minimum length, pooled across ranks."""
    mask = words < MIN_WORDS
    if not bool(mask.any()):
        return None
    stats = torch.stack([(preds[mask] - targets[mask]).abs().sum(), mask.sum().float()])
    dist.all_reduce(stats)  # zoo: place
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def predict(net, x, chunk=128):
    net.eval()
    out = torch.cat([net(x[i:i + chunk]) for i in range(0, len(x), chunk)])
    net.train()
    return out


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    out_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "aes")
    os.makedirs(out_dir, exist_ok=True)

    x_tr, y_tr, _ = synth_essays(2048, seed=11)
    x_va, y_va, w_va = synth_essays(256, seed=12)
    train_ds = TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    loader = DataLoader(train_ds, batch_size=BATCH, sampler=sampler)

    # each rank scores its own contiguous slice of the held-out export
    val_idx = np.array_split(np.arange(len(y_va)), world)[rank]
    xv = torch.from_numpy(x_va[val_idx])
    yv = torch.from_numpy(y_va[val_idx])
    wv = torch.from_numpy(w_va[val_idx])

    model = DDP(Scorer(x_tr.shape[1]))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-4)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        t0 = time.time()
        running = 0.0
        for step, (xb, yb) in enumerate(loader):  # noqa: B007
            loss = F.smooth_l1_loss(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.item()

        preds = predict(model.module, xv)
        mae = global_mae(preds, yv)
        short_mae = short_essay_report(preds, yv, wv)
        if rank == 0:
            msg = f"epoch {epoch} train_loss {running / (step + 1):.4f} val_mae {mae:.3f}"
            if short_mae is not None:
                msg += f" short_mae {short_mae:.3f}"
            print(msg + f" ({time.time() - t0:.1f}s)", flush=True)
            torch.save(model.module.state_dict(), os.path.join(out_dir, f"scorer_e{epoch}.pt"))
        dist.barrier()

    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
