"""Paraphrase detection with a siamese bag-of-embeddings encoder, DDP on CPU.

What the job does
    Sentence pairs (token ids) are encoded by a shared EmbeddingBag, combined as
    [u, v, |u-v|, u*v] and classified paraphrase / not. Training uses word
    dropout and annealed gradient noise (Neelakantan et al., 2015) as
    regularisers. Rank 0 prints validation accuracy of its own replica.

Root cause
    After wrapping the model, main() reseeds torch with seed + rank so that the
    word-dropout masks differ across ranks. `add_gradient_noise` then draws the
    gradient noise from that per-rank RNG and adds it to .grad *after* DDP's
    all-reduce, so every rank applies a different update. The replicas' weights
    drift apart a little every step; the job finishes with exit code 0 and
    nothing in the logs shows it.

Fix
    Draw the noise from a torch.Generator seeded identically on every rank (or
    broadcast it from rank 0), or add the noise before the gradients are
    all-reduced (e.g. in a DDP comm hook), so the averaged update stays
    identical on all ranks.

Observed (plain run)
    rc 0 in ~6 s, no warnings. Rank 0 prints "epoch 0 step 63 loss 0.9295
    val_acc 0.636", "epoch 1 step 126 loss 0.5072 val_acc 0.723",
    "epoch 2 step 189 loss 0.7673 val_acc 0.728". A copy that all_gathers the
    flattened parameters at the end shows max |w_rank0 - w_rank1| ~= 1.0 (parameter
    RMS ~0.94); with noise_eta=0 the same check gives exactly 0.0.
"""
import gc
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = {
    "kind": ["weights_diverged", "model_differs", "gradients_not_synced"],
    "rank": None,
    "fix": ["generator", "seed", "broadcast", "before the all-reduce", "comm hook", "identical"],
    "options": [],
}

CFG = dict(vocab=3000, seq_len=12, dim=64, batch=32, epochs=3, lr=0.1,
           word_dropout=0.1, noise_eta=0.001, noise_gamma=0.55, seed=2718)


def make_pairs(n, cfg, seed):
    g = torch.Generator().manual_seed(seed)
    V, L = cfg["vocab"], cfg["seq_len"]
    a = torch.randint(0, V, (n, L), generator=g)
    label = (torch.rand(n, generator=g) < 0.5).long()
    # paraphrase: swap some words for their synonym, shuffle a little
    synonym = (a + V // 2) % V
    swap = torch.rand(n, L, generator=g) < 0.5
    para = torch.where(swap, synonym, a)
    para = para[:, torch.randperm(L, generator=g)]
    other = torch.randint(0, V, (n, L), generator=g)
    keep = torch.rand(n, L, generator=g) < 0.25
    other = torch.where(keep, a, other)
    b = torch.where(label.view(-1, 1) == 1, para, other)
    return a, b, label


class SiameseBag(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.enc = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.cls = nn.Sequential(nn.Linear(4 * dim, 128), nn.ReLU(), nn.Linear(128, 2))

    def forward(self, a, b):
        u, v = self.enc(a), self.enc(b)
        return self.cls(torch.cat([u, v, (u - v).abs(), u * v], dim=-1))


def word_dropout(tokens, p, unk=0):
    if p <= 0:
        return tokens
    return tokens.masked_fill(torch.rand(tokens.shape) < p, unk)


def add_gradient_noise(params, step, eta, gamma):
    sigma = math.sqrt(eta / (1 + step) ** gamma)
    for p in params:
        if p.grad is not None:
            p.grad.add_(torch.randn_like(p.grad) * sigma)  # zoo: place


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(CFG["seed"])
    out_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "paraphrase")
    os.makedirs(out_dir, exist_ok=True)

    a, b, y = make_pairs(4000, CFG, seed=1)
    va, vb, vy = make_pairs(800, CFG, seed=2)
    ds = TensorDataset(a, b, y)
    sampler = DistributedSampler(ds, shuffle=True, seed=CFG["seed"])
    loader = DataLoader(ds, batch_size=CFG["batch"], sampler=sampler)

    model = DDP(SiameseBag(CFG["vocab"], CFG["dim"]))
    opt = torch.optim.SGD(model.parameters(), lr=CFG["lr"], momentum=0.9)
    # different word-dropout masks on each rank
    torch.manual_seed(CFG["seed"] + rank)

    step = 0
    for epoch in range(CFG["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for xa, xb, yb in loader:
            xa = word_dropout(xa, CFG["word_dropout"])
            xb = word_dropout(xb, CFG["word_dropout"])
            loss = F.cross_entropy(model(xa, xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            add_gradient_noise(model.parameters(), step, CFG["noise_eta"], CFG["noise_gamma"])
            opt.step()
            step += 1
        if rank == 0:
            model.eval()
            with torch.no_grad():
                acc = (model.module(va, vb).argmax(1) == vy).float().mean().item()
            print(f"epoch {epoch} step {step} loss {loss.item():.4f} val_acc {acc:.3f}", flush=True)

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(out_dir, "siamese.pt"))
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
