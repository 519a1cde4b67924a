"""Per-language adapters: an adapter unused on one rank with find_unused_parameters=False.

Story: a multilingual sentence classifier has a shared encoder plus one small adapter
per language (`nn.ModuleDict`); `forward` only runs the adapters of the languages present
in the batch.  DDP is built with the default find_unused_parameters=False because "every
batch is mixed".  Batches are mixed on rank 0, but rank 1's shard contains a stretch
from a German/English-only file: at step 12 its batch has no 'fi' or 'sw' rows, so those
adapters get no gradient on rank 1.  DDP's reducer on rank 1 never finishes that
iteration and rank 1 fails at its next forward with "Expected to have finished reduction
in the prior iteration ..."; rank 0 is stuck/fails in the gradient all-reduce.

Root cause: rank 1 (the rank whose batch left parameters without gradient); the
underlying misuse is DDP with find_unused_parameters=False on a data-dependent graph.
Right diagnosis: DDP unused-parameter error (parameters that did not receive gradients
on rank 1: the per-language adapters).
Fix: construct DDP with find_unused_parameters=True (or make every adapter take part in
every forward, e.g. run all adapters and mask).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": None, "rank": 1, "fix": ["find_unused_parameters", "unused"], "options": []}

LANGS = ["en", "de", "fi", "sw"]


class AdapterClassifier(nn.Module):
    def __init__(self, vocab=400, dim=32, classes=3):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, dim)
        self.shared = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.adapters = nn.ModuleDict({lang: nn.Linear(dim, dim) for lang in LANGS})
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens, lang_ids):
        h = self.shared(self.emb(tokens))
        out = torch.zeros_like(h)
        for lid in lang_ids.unique().tolist():
            m = lang_ids == lid
            out[m] = h[m] + self.adapters[LANGS[lid]](h[m])
        return self.head(out)


def get_batch(rank, step, g, bs=24):
    tokens = torch.randint(0, 400, (bs, 16), generator=g)
    labels = torch.randint(0, 3, (bs,), generator=g)
    if rank == 1 and step >= 12:
        langs = torch.randint(0, 2, (bs,), generator=g)  # de/en-only file
    else:
        langs = torch.arange(bs) % len(LANGS)
    return tokens, langs, labels


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(AdapterClassifier())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(40):
        tokens, langs, labels = get_batch(rank, step, g)
        loss = F.cross_entropy(model(tokens, langs), labels)  # zoo: place
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
