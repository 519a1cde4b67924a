"""Tiny decoder-only transformer for code-token completion, trained with DDP.

Story
-----
A 2-layer causal transformer over a tokenised corpus of short Python-like functions (keywords,
identifiers, operators, literals, INDENT/NEWLINE tokens) learns next-token prediction for an
editor autocomplete prototype.  The model has token embeddings, learned absolute position
embeddings, two pre-norm encoder layers with a causal mask and a tied LM head.

Root cause
----------
While adding dropout to the embeddings, `CodeLM.forward` was rewritten and the position
embedding term was dropped: `h = self.drop(self.tok_emb(idx))` instead of
`self.drop(self.tok_emb(idx) + self.pos_emb(pos))`.  The next run failed with DDP's "Expected to
have finished reduction in the prior iteration ... parameters that were not used in producing
loss" error, and the author "fixed" it by passing `find_unused_parameters=True`.  Since then the
job runs without any error, but `pos_emb.weight` never receives a gradient on any rank (it stays
at its initial values), DDP traverses the autograd graph every step looking for unused
parameters, and the model has no positional information except through the causal mask.
Fix: use the position embedding in forward (add `self.pos_emb(pos)`) and drop
`find_unused_parameters=True`.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): exit code 0 in ~8-9 s,
no warning; val perplexity 20.5 -> 8.9; both ranks print the same parameter checksum and report
`params without grad: ['pos_emb.weight']`.  Without find_unused_parameters=True the same script
fails at step 2 on both ranks with "Expected to have finished reduction in the prior iteration
before starting a new one".
"""
import logging
import math
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
    "kind": ["unused_parameters"],
    "rank": None,
    "fix": ["pos_emb", "forward"],
    "options": [],
}

KEYWORDS = ["def", "return", "if", "else", "for", "in", "while", "None", "True", "False"]
OPS = ["(", ")", ":", ",", "=", "+", "-", "*", "<", ">", "==", "[", "]", "."]
SPECIAL = ["<pad>", "<bos>", "NEWLINE", "INDENT", "DEDENT"]
IDENTS = [f"v{i}" for i in range(16)] + ["len", "range", "print", "append", "self", "x", "y"]
LITERALS = ["0", "1", "2", "10", "''", "[]"]
VOCAB = SPECIAL + KEYWORDS + OPS + IDENTS + LITERALS
TOK = {t: i for i, t in enumerate(VOCAB)}
SEQ = 48
EPOCHS = 3
BATCH = 32
SEED = 77

log = logging.getLogger("codelm")


def synth_function(g):
    def pick(xs):
        return xs[int(torch.randint(0, len(xs), (1,), generator=g))]

    name, a, b, acc = pick(IDENTS[:16]), pick(IDENTS[:16]), pick(IDENTS[:16]), pick(IDENTS[:16])
    body = ["def", name, "(", a, ",", b, ")", ":", "NEWLINE", "INDENT",
            acc, "=", pick(LITERALS[:4]), "NEWLINE",
            "for", "x", "in", "range", "(", "len", "(", a, ")", ")", ":", "NEWLINE", "INDENT",
            "if", a, "[", "x", "]", pick(["<", ">", "=="]), b, ":", "NEWLINE", "INDENT",
            acc, "=", acc, pick(["+", "-", "*"]), a, "[", "x", "]", "NEWLINE",
            "DEDENT", "DEDENT", "return", acc, "NEWLINE", "DEDENT"]
    ids = [TOK["<bos>"]] + [TOK[t] for t in body]
    ids = ids[:SEQ + 1]
    return ids + [TOK["<pad>"]] * (SEQ + 1 - len(ids))


def build_corpus(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([synth_function(g) for _ in range(n)])


class CodeLM(nn.Module):
    def __init__(self, d=64, heads=4, layers=2):
        super().__init__()
        self.tok_emb = nn.Embedding(len(VOCAB), d)
        self.pos_emb = nn.Embedding(SEQ, d)
        self.drop = nn.Dropout(0.1)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, len(VOCAB), bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying
        mask = torch.triu(torch.full((SEQ, SEQ), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)  # noqa: F841
        h = self.drop(self.tok_emb(idx))  # zoo: place
        h = self.blocks(h, mask=self.causal_mask[:T, :T], is_causal=True)
        return self.lm_head(self.norm(h))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=TOK["<pad>"])


@torch.no_grad()
def evaluate(model, data):
    model.eval()
    logits = model(data[:, :-1])
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), data[:, 1:].reshape(-1),
                          ignore_index=TOK["<pad>"], reduction="sum")
    ntok = (data[:, 1:] != TOK["<pad>"]).sum()
    stats = torch.tensor([nll.item(), float(ntok)])
    dist.all_reduce(stats)
    model.train()
    return math.exp(stats[0] / stats[1])


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED)

    train = build_corpus(1024, SEED)
    val = build_corpus(128, SEED + 1)[rank::world]
    ds = TensorDataset(train)
    sampler = DistributedSampler(ds, shuffle=True, seed=SEED)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, drop_last=True)

    # find_unused_parameters=True: without it DDP complained about unused parameters
    model = DDP(CodeLM(), find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.98), weight_decay=0.01)
    total_steps = EPOCHS * len(loader)
    warmup = 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / total_steps)))
    ckpt = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "codelm_ho24.pt")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        t0, tot = time.time(), 0.0
        for (seq,) in loader:
            logits = model(seq[:, :-1])
            loss = lm_loss(logits, seq[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += loss.item()
        ppl = evaluate(model, val)
        if rank == 0:
            log.info("epoch %d loss %.4f val ppl %.2f (%.1fs)", epoch, tot / len(loader), ppl,
                     time.time() - t0)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "vocab": VOCAB}, ckpt)

    no_grad = [n for n, p in model.module.named_parameters() if p.grad is None]
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] param checksum {checksum:.10f} params without grad: {no_grad}",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
