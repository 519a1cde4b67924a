"""Knowledge-graph completion with TransE (head + relation ~= tail).

Entity and relation embeddings are trained with a margin ranking loss against
tail-corrupted negatives. As in the TransE paper, entity vectors are kept on the unit
sphere: after each optimizer step, `TransE.renorm_entities()` projects the entity rows
that took part in the batch back to norm 1.

Root cause: the projection is an in-place write under no_grad to the rows indexed by
the rank's *own* batch (positives and its locally drawn negatives). Each rank
renormalises a different set of rows, so the entity table differs between replicas
after the first step, and keeps drifting: DDP only averages gradients, it never
re-syncs the weights. Exit code 0, no warning.

Fix: make the constraint identical on every rank: renormalise all entity rows, or
all_gather the batch indices from every rank and renormalise their union (or apply it
as part of the forward/loss instead of as a local in-place edit).

Observed (plain run): exit 0 in ~6 s; margin loss falls and hits@10 (rank 0's replica)
rises from 0.04 to 0.26. Checked separately: the entity table differs between the ranks,
max |diff| ~7.9e-3 (entity vectors have unit norm, components ~0.2); the relation table is
identical (it is never renormalised).
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
          "fix": ["all_gather", "all rows", "every rank", "all_reduce", "broadcast"],
          "options": []}

N_ENT, N_REL, DIM = 400, 12, 32


def synth_graph(n_triples, seed):
    g = torch.Generator().manual_seed(seed)
    ent = F.normalize(torch.randn(N_ENT, 8, generator=g), dim=1)
    rel = torch.randn(N_REL, 8, generator=g) * 0.4
    h = torch.randint(0, N_ENT, (n_triples,), generator=g)
    r = torch.randint(0, N_REL, (n_triples,), generator=g)
    target = ent[h] + rel[r]
    t = torch.cdist(target, ent).topk(3, largest=False).indices[
        torch.arange(n_triples), torch.randint(0, 3, (n_triples,), generator=g)]
    return torch.stack([h, r, t], dim=1)


class TransE(nn.Module):
    def __init__(self, margin=1.0):
        super().__init__()
        self.ent = nn.Embedding(N_ENT, DIM)
        self.rel = nn.Embedding(N_REL, DIM)
        nn.init.uniform_(self.ent.weight, -6 / DIM ** 0.5, 6 / DIM ** 0.5)
        nn.init.uniform_(self.rel.weight, -6 / DIM ** 0.5, 6 / DIM ** 0.5)
        self.margin = margin

    def score(self, h, r, t):
        return (self.ent(h) + self.rel(r) - self.ent(t)).norm(p=1, dim=-1)

    def forward(self, pos, neg):
        sp = self.score(pos[:, 0], pos[:, 1], pos[:, 2])
        sn = self.score(neg[:, 0], neg[:, 1], neg[:, 2])
        return F.relu(self.margin + sp - sn).mean()

    @torch.no_grad()
    def renorm_entities(self, idx):
        idx = idx.unique()
        self.ent.weight[idx] = F.normalize(self.ent.weight[idx], p=2, dim=1)  # zoo: place


def corrupt_tails(pos, generator):
    neg = pos.clone()
    neg[:, 2] = torch.randint(0, N_ENT, (pos.shape[0],), generator=generator)
    return neg


@torch.no_grad()
def hits_at_10(model, triples):
    ent, rel = model.ent.weight, model.rel.weight
    q = ent[triples[:, 0]] + rel[triples[:, 1]]
    d = torch.cdist(q, ent, p=1)
    rank_of_true = (d < d.gather(1, triples[:, 2:3])).sum(1)
    return (rank_of_true < 10).float().mean().item()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()  # noqa: F841
    torch.manual_seed(0)

    triples = synth_graph(6000, seed=42)
    train, valid = triples[:5400], triples[5400:]
    ds = TensorDataset(train)
    sampler = DistributedSampler(ds, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=128, sampler=sampler, drop_last=True)
    neg_gen = torch.Generator().manual_seed(100 + rank)

    model = DDP(TransE())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)

    for epoch in range(8):
        sampler.set_epoch(epoch)
        total = 0.0
        for (pos,) in loader:
            neg = corrupt_tails(pos, neg_gen)
            loss = model(pos, neg)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            model.module.renorm_entities(torch.cat([pos[:, 0], pos[:, 2], neg[:, 2]]))
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch}: margin loss {total / len(loader):.4f} "
                  f"hits@10 {hits_at_10(model.module, valid):.3f}", flush=True)

    if rank == 0:
        out = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
        os.makedirs(out, exist_ok=True)
        torch.save({"ent": model.module.ent.weight.detach(), "rel": model.module.rel.weight.detach()},
                   os.path.join(out, "kgembed_heldout29_embeddings.pt"))
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
