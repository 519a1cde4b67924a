"""Contract-clause classification for a legal document review tool.

An EmbeddingBag + MLP classifier labels contract clauses (indemnity, termination,
confidentiality, governing law, payment, liability cap) from hashed word ids. To avoid
every rank re-deriving them, rank 0 alone computes "domain-pretrained" word vectors (a cheap
co-occurrence SVD on the clause corpus) and copies them into the embedding table. The copy
happens in init_embeddings(), which the script calls *after* wrapping the model in DDP --
DDP only broadcasts rank 0's parameters once, in its constructor, so rank 1 keeps its random
embedding table. From then on both ranks apply identical averaged gradients to different
starting weights: no error, no warning, just two different models.

Root cause: init_embeddings() overwrites model.module.emb.weight in place on rank 0 only,
after DDP construction, so the ranks' parameters are never re-synchronised.
Plain run (measured): exits 0 in ~5 s; final parameter checksums (sum of |p|) rank 0
11008.271564 vs rank 1 51755.452796 (with the bug removed they would be identical).
Fix: load/initialise the embeddings before wrapping in DDP (on every rank, or on rank 0 and
let the DDP constructor broadcast), or broadcast the parameters from rank 0 after the copy
(dist.broadcast).
"""

import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": ["weights_diverged"],
    "rank": 0,
    "fix": [
        "before wrapping",
        "before ddp",
        "before",
        "broadcast",
        "every rank",
        "all ranks",
        "sync",
        "load",
        "init",
        "initialise",
        "initialize",
        "construct",
        "rank 0 only",
        "in place",
    ],
    "options": [],
}

CLASSES = ["indemnity", "termination", "confidentiality", "governing_law", "payment", "liability_cap"]
VOCAB = 2000
DIM = 32
CLAUSE_LEN = 24


def synth_clauses(n, seed):
    rng = random.Random(seed)
    topic_words = {c: [rng.randrange(VOCAB) for _ in range(40)] for c in range(len(CLASSES))}
    rng2 = random.Random(seed * 31 + 1)
    docs, labels = [], []
    for _ in range(n):
        c = rng2.randrange(len(CLASSES))
        words = [
            rng2.choice(topic_words[c]) if rng2.random() < 0.4 else rng2.randrange(VOCAB)
            for _ in range(CLAUSE_LEN)
        ]
        docs.append(words)
        labels.append(c)
    return torch.tensor(docs), torch.tensor(labels)


class ClauseClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, DIM, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, len(CLASSES)))

    def forward(self, ids):
        return self.mlp(self.emb(ids))


def cooccurrence_vectors(docs):
    co = torch.zeros(VOCAB, VOCAB)
    for d in docs[:600]:
        u = torch.unique(d)
        co[u[:, None], u[None, :]] += 1
    co = torch.log1p(co)
    u, s, _ = torch.svd_lowrank(co, q=DIM)
    v = u * s.sqrt()
    return v / v.norm(dim=1, keepdim=True).clamp(min=1e-6)


def init_embeddings(model, docs):
    vectors = cooccurrence_vectors(docs)
    with torch.no_grad():
        model.module.emb.weight.copy_(vectors)  # zoo: place


def param_checksum(model):
    return sum(p.detach().double().abs().sum().item() for p in model.parameters())


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    docs, labels = synth_clauses(2400, seed=5)
    mine = slice(rank, None, dist.get_world_size())
    x, y = docs[mine], labels[mine]
    torch.manual_seed(rank)  # per-rank seed for dropout/augmentation; DDP syncs the init anyway
    model = DDP(ClauseClassifier())
    if rank == 0:
        init_embeddings(model, docs)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    bs = 32
    for step in range(1, 151):
        i = (step * bs) % (len(x) - bs)
        loss = F.cross_entropy(model(x[i : i + bs]), y[i : i + bs])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    print(f"rank {rank} param checksum {param_checksum(model):.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
