"""Routing customer-support tickets to teams (billing / shipping / account / bug).

A bag-of-embeddings classifier (EmbeddingBag + MLP) routes synthetic support tickets. The
team has "pretrained" domain word vectors (here generated deterministically from a
co-occurrence sketch of a synthetic corpus) and injects them into the embedding table. The
vectors are read by the main process only -- "to avoid every rank hitting the shared
filesystem" -- and the injection happens after the model was wrapped in DDP.

Root cause: inject_pretrained_vectors() runs on rank 0 only and after DDP(...) was constructed,
so DDP's initial parameter broadcast has already happened: rank 0's embedding table differs
from rank 1's. Gradients are averaged, so both ranks apply identical updates to different
weights and the replicas stay different for the whole run -- silently.
Fix: load the pretrained vectors on every rank (or before wrapping the model in DDP, so the
constructor broadcasts rank 0's weights), or broadcast the parameters from rank 0 after loading.
"""

import hashlib
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
        "every rank",
        "all ranks",
        "each rank",
        "before",
        "wrap",
        "broadcast",
        "construct",
        "ddp(",
        "sync",
        "same weights",
        "load",
        "rank 0",
        "module_states",
        "identical",
    ],
    "options": [],
}

TEAMS = ["billing", "shipping", "account", "bug"]
TOPIC_WORDS = {
    "billing": ["invoice", "refund", "charge", "card", "payment", "vat", "receipt"],
    "shipping": ["parcel", "courier", "tracking", "delivery", "late", "address", "customs"],
    "account": ["password", "login", "email", "reset", "locked", "profile", "2fa"],
    "bug": ["crash", "error", "button", "page", "freeze", "app", "blank"],
}
COMMON = ["hi", "please", "help", "my", "the", "is", "not", "thanks", "urgent", "order", "again", "today"]
VOCAB = ["<pad>"] + COMMON + [w for ws in TOPIC_WORDS.values() for w in ws]
W2I = {w: i for i, w in enumerate(VOCAB)}
DIM = 16


def synth_tickets(n, seed):
    rng = random.Random(seed)
    docs, labels = [], []
    for _ in range(n):
        team = rng.randrange(len(TEAMS))
        words = rng.sample(COMMON, 4) + rng.choices(TOPIC_WORDS[TEAMS[team]], k=3)
        if rng.random() < 0.3:  # tickets mention other topics too
            words += rng.choices(TOPIC_WORDS[rng.choice(TEAMS)], k=2)
        rng.shuffle(words)
        docs.append([W2I[w] for w in words])
        labels.append(team)
    return docs, torch.tensor(labels)


def pretrained_vectors():
    """Deterministic stand-in for reading domain vectors from shared storage."""
    vecs = torch.zeros(len(VOCAB), DIM)
    for w, i in W2I.items():
        h = int(hashlib.sha1(w.encode()).hexdigest()[:8], 16)
        g = torch.Generator().manual_seed(h)
        vecs[i] = torch.randn(DIM, generator=g) * 0.5
    for t, ws in enumerate(TOPIC_WORDS.values()):
        for w in ws:
            vecs[W2I[w], t] += 2.0  # topic words share a direction
    return vecs


class TicketRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(len(VOCAB), DIM, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, len(TEAMS)))

    def forward(self, flat, offsets):
        return self.mlp(self.emb(flat, offsets))


def inject_pretrained_vectors(module):
    with torch.no_grad():
        module.emb.weight.copy_(pretrained_vectors())


def collate(docs):
    offsets = torch.tensor([0] + [len(d) for d in docs[:-1]]).cumsum(0)
    return torch.tensor([w for d in docs for w in d]), offsets


def checksum(model):
    return torch.stack([p.detach().double().sum() for p in model.parameters()])


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    docs, labels = synth_tickets(1600, seed=10 + rank)
    torch.manual_seed(0)
    model = DDP(TicketRouter())
    if rank == 0:
        inject_pretrained_vectors(model.module)  # zoo: place
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    bs = 32
    for step in range(120):
        i = (step * bs) % len(docs)
        flat, off = collate(docs[i : i + bs])
        loss = F.cross_entropy(model(flat, off), labels[i : i + bs])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 30 == 29:
            with torch.no_grad():
                acc = (model.module(flat, off).argmax(-1) == labels[i : i + bs]).float().mean()
            print(f"rank {rank} step {step + 1} loss {loss.item():.3f} acc {acc:.2f}", flush=True)
    cs = checksum(model.module)
    gathered = [torch.zeros_like(cs) for _ in range(world)]
    dist.all_gather(gathered, cs)
    if rank == 0:
        for r, g in enumerate(gathered):
            print(f"rank {r} per-parameter sums: " + " ".join(f"{v:.4f}" for v in g.tolist()), flush=True)
        print("max |difference| across ranks:", (gathered[0] - gathered[1]).abs().max().item(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
