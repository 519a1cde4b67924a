"""Protein secondary-structure (Q3) tagger trained with DDP.

Story
-----
A residue-level tagger predicts helix / strand / coil for every residue of a protein chain
(residue embedding -> dilated 1-D convolutions -> per-residue classifier).  Training chains
come from a curated set that only uses the 20 standard residues.  Validation chains come from
a different source that occasionally contains non-standard residues ('U' selenocysteine).

The residue vocabulary is "owned" by rank 0.  `encode_chains()` calls `_pull_residue_table()`
whenever it meets a residue it does not know, which re-fetches the canonical table from rank 0
with `dist.broadcast(table, src=0)` so that every rank maps residues to the same index.

Root cause
----------
The validation set is sharded with `chains[rank::world]`; the only chain that carries a 'U'
lands on rank 1.  Rank 1 therefore enters the broadcast inside `_pull_residue_table()` while
rank 0 never reaches it (rank 0 has no unknown residue) and instead goes on to the epoch-metric
all_reduce.  The two ranks' collectives no longer pair up and both wait forever (gloo's default
timeout is 30 minutes).
Fix: never run a collective under a data-dependent condition that only some ranks meet; use a
fixed vocabulary (map unknown residues to 'X') or do the table sync unconditionally on all ranks.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): hangs in the first
validation (~3 s after start) until `timeout 60` kills torchrun (rc 124).  The last log line is
"[rank1] unknown residue 'U' in validation chain, syncing residue table"; py-spy shows rank 1
blocked in dist.broadcast (_pull_residue_table <- encode_chains <- evaluate) and rank 0
blocked in dist.all_reduce in evaluate().
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

EXPECT = {
    "kind": ["hang", "rank_only_collective", "collective_mismatch"],
    "rank": 1,
    "fix": ["broadcast", "ranks", "condition"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

STANDARD = "ACDEFGHIKLMNPQRSTVWY"
HELIX_FORMERS = set("AELMQKRH")
STRAND_FORMERS = set("VIYFWTC")
CHAIN_LEN = 64
EMB_SLOTS = 32  # room for non-standard residues
EPOCHS = 3
BATCH = 32
LR = 3e-3
SEED = 1234

log = logging.getLogger("q3")


# --------------------------------------------------------------------------- data
def synth_chain(gen):
    idx = torch.randint(0, len(STANDARD), (CHAIN_LEN,), generator=gen)
    return "".join(STANDARD[i] for i in idx.tolist())


def q3_labels(seq):
    """Toy DSSP substitute: smoothed helix/strand propensities decide the state."""
    h = torch.tensor([1.0 if c in HELIX_FORMERS else 0.0 for c in seq])
    e = torch.tensor([1.0 if c in STRAND_FORMERS else 0.0 for c in seq])
    k = torch.ones(1, 1, 5) / 5.0
    hs = F.conv1d(h.view(1, 1, -1), k, padding=2).view(-1)
    es = F.conv1d(e.view(1, 1, -1), k, padding=2).view(-1)
    lab = torch.full((len(seq),), 2, dtype=torch.long)  # coil
    lab[(hs >= 0.6) & (hs >= es)] = 0
    lab[(es >= 0.4) & (es > hs)] = 1
    return lab


def build_split(n, seed, rare_at=()):
    gen = torch.Generator().manual_seed(seed)
    chains = [synth_chain(gen) for _ in range(n)]
    for i in rare_at:  # selenoproteins from the external benchmark
        c = list(chains[i])
        c[CHAIN_LEN // 2] = "U"
        chains[i] = "".join(c)
    labels = [q3_labels(c) for c in chains]
    return chains, labels


class ResidueVocab:
    def __init__(self):
        self.table = torch.full((26,), -1, dtype=torch.long)
        for i, c in enumerate(STANDARD):
            self.table[ord(c) - 65] = i
        self.next_free = len(STANDARD)

    def lookup(self, c):
        return int(self.table[ord(c) - 65])

    def add(self, c):
        self.table[ord(c) - 65] = self.next_free
        self.next_free += 1


def _pull_residue_table(vocab):
    """Rank 0 owns the vocabulary; refresh our copy of the table from it."""
    dist.broadcast(vocab.table, src=0)  # zoo: place
    vocab.next_free = int(vocab.table.max()) + 1


def encode_chains(chains, vocab):
    out = torch.empty(len(chains), CHAIN_LEN, dtype=torch.long)
    for r, seq in enumerate(chains):
        for p, c in enumerate(seq):
            code = vocab.lookup(c)
            if code < 0:
                log.info("unknown residue %r in validation chain, syncing residue table", c)
                vocab.add(c)
                _pull_residue_table(vocab)
                code = max(vocab.lookup(c), 0)
            out[r, p] = code
    return out


# --------------------------------------------------------------------------- model
class DilatedBlock(nn.Module):
    def __init__(self, ch, dilation):
        super().__init__()
        self.conv = nn.Conv1d(ch, ch, 3, padding=dilation, dilation=dilation)
        self.norm = nn.GroupNorm(4, ch)

    def forward(self, x):
        return x + F.gelu(self.norm(self.conv(x)))


class Q3Tagger(nn.Module):
    def __init__(self, dim=48):
        super().__init__()
        self.emb = nn.Embedding(EMB_SLOTS, dim)
        self.blocks = nn.Sequential(*[DilatedBlock(dim, d) for d in (1, 2, 4)])
        self.head = nn.Conv1d(dim, 3, 1)

    def forward(self, tokens):
        x = self.emb(tokens).transpose(1, 2)
        return self.head(self.blocks(x))  # (B, 3, L)


# --------------------------------------------------------------------------- loops
def evaluate(model, chains, labels, vocab):
    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(chains), BATCH):
            tok = encode_chains(chains[i:i + BATCH], vocab)
            y = torch.stack(labels[i:i + BATCH])
            logits = model(tok)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            count += y.numel()
    stats = torch.tensor([loss_sum, correct, count], dtype=torch.float64)
    dist.all_reduce(stats)
    model.train()
    return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED)

    train_chains, train_labels = build_split(512, SEED)
    val_chains, val_labels = build_split(97, SEED + 1, rare_at=(37,))
    train_chains, train_labels = train_chains[rank::world], train_labels[rank::world]
    val_chains, val_labels = val_chains[rank::world], val_labels[rank::world]

    vocab = ResidueVocab()
    train_tok = encode_chains(train_chains, vocab)
    train_y = torch.stack(train_labels)

    model = DDP(Q3Tagger())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=1e-2)
    gen = torch.Generator().manual_seed(SEED + rank)
    ckpt = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "q3_tagger_ho24.pt")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)

    for epoch in range(EPOCHS):
        t0 = time.time()
        perm = torch.randperm(len(train_tok), generator=gen)
        running = 0.0
        for step in range(len(perm) // BATCH):
            idx = perm[step * BATCH:(step + 1) * BATCH]
            logits = model(train_tok[idx])
            loss = F.cross_entropy(logits, train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.item()
        val_loss, val_acc = evaluate(model, val_chains, val_labels, vocab)
        if rank == 0:
            log.info("epoch %d train %.4f val %.4f q3 %.3f (%.1fs)", epoch,
                     running / max(1, len(perm) // BATCH), val_loss, val_acc, time.time() - t0)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, ckpt)

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] param checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
