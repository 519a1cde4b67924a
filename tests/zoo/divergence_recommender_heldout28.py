"""Implicit-feedback recommender (neural matrix factorisation: user/item embeddings +
MLP scorer, BCE with sampled negatives), trained with DDP (gloo, CPU).

What the job does
    Synthetic user-item interactions are drawn from hidden taste factors.  Before
    training, the item tower is warm-started from "item2vec" vectors: a truncated SVD
    of the item-item co-occurrence matrix.  Because the SVD is the expensive part, the
    warm start is done by the main process only, after the model has been wrapped in
    DDP ("DDP keeps the replicas in sync").  Training runs 3 epochs with
    DistributedSampler + set_epoch, then rank 0 saves model.module.state_dict().

Root cause
    DDP broadcasts rank 0's parameters once, in its constructor.  warm_start_items()
    writes the item2vec vectors into item_emb.weight on rank 0 only, outside autograd
    and after the wrap, so rank 1 keeps its random item embeddings.  From then on both
    ranks apply identical averaged gradients to different weights: the replicas stay
    different for the whole run (and the saved checkpoint only reflects rank 0).  No
    error is raised; the job exits 0.

Fix
    Warm-start before wrapping the model in DDP (the constructor then broadcasts the
    weights), or do it on every rank, or dist.broadcast() the item table from rank 0
    after loading it.

Observed (plain run: OMP_NUM_THREADS=1 timeout 90 torchrun --standalone --nproc_per_node 2)
    Exit code 0 in ~5-10 s, no warning or error.  Output: "warm-started 900 item
    vectors from item2vec" (rank 0 only), then "epoch 0: bce 0.6592",
    "epoch 1: bce 0.5997", "epoch 2: bce 0.5795".  An instrumented run that
    all-gathered the parameters at destroy_process_group() found rank 1's
    parameters differing from rank 0's by up to 0.949 (max abs) after training,
    rank 0 vs itself 0.
"""
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = {
    "kind": ["weights_diverged", "model_differs"],
    "rank": 0,
    "fix": ["broadcast", "before DDP", "before wrapping", "every rank", "all ranks"],
    "options": [],
}

SEED = 4242
N_USERS = 600
N_ITEMS = 900
N_FACTORS = 8
DIM = 32
N_INTERACTIONS = 12000
NEG_PER_POS = 2
BATCH = 256
EPOCHS = 3
OUT_DIR = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "recsys_ncf")


def simulate_interactions(seed):
    g = torch.Generator().manual_seed(seed)
    user_taste = torch.randn(N_USERS, N_FACTORS, generator=g)
    item_style = torch.randn(N_ITEMS, N_FACTORS, generator=g)
    popularity = -torch.rand(N_ITEMS, generator=g).log()
    affinity = user_taste @ item_style.T + 0.5 * popularity.log1p()
    probs = torch.softmax(affinity / 1.5, dim=1)
    users = torch.randint(0, N_USERS, (N_INTERACTIONS,), generator=g)
    items = torch.multinomial(probs[users], 1, generator=g).squeeze(1)
    return users, items


class InteractionDataset(Dataset):
    """Each positive (user, item) comes with NEG_PER_POS uniformly sampled negatives."""

    def __init__(self, users, items, seed):
        self.users, self.items = users, items
        self.seed = seed

    def __len__(self):
        return len(self.users)

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(self.seed + idx)
        negs = torch.randint(0, N_ITEMS, (NEG_PER_POS,), generator=g)
        item_ids = torch.cat([self.items[idx:idx + 1], negs])
        labels = torch.tensor([1.0] + [0.0] * NEG_PER_POS)
        return self.users[idx].repeat(1 + NEG_PER_POS), item_ids, labels


class NeuralMF(nn.Module):
    def __init__(self):
        super().__init__()
        self.user_emb = nn.Embedding(N_USERS, DIM)
        self.item_emb = nn.Embedding(N_ITEMS, DIM)
        nn.init.normal_(self.user_emb.weight, std=0.1)
        nn.init.normal_(self.item_emb.weight, std=0.1)
        self.scorer = nn.Sequential(nn.Linear(3 * DIM, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, users, items):
        u, v = self.user_emb(users), self.item_emb(items)
        return self.scorer(torch.cat([u, v, u * v], dim=-1)).squeeze(-1)


def item2vec_table(users, items):
    co = torch.zeros(N_USERS, N_ITEMS)
    co.index_put_((users, items), torch.ones(len(users)), accumulate=True)
    item_item = co.T @ co
    item_item = torch.log1p(item_item)
    u, s, _ = torch.linalg.svd(item_item)
    vecs = u[:, :DIM] * s[:DIM].sqrt()
    return 0.1 * vecs / vecs.std()


def warm_start_items(model, users, items):
    if dist.get_rank() != 0:
        return
    table = item2vec_table(users, items)
    with torch.no_grad():
        model.module.item_emb.weight.copy_(table)  # zoo: place
    print(f"warm-started {table.shape[0]} item vectors from item2vec", flush=True)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)

    users, items = simulate_interactions(SEED)
    ds = InteractionDataset(users, items, SEED)
    sampler = DistributedSampler(ds, shuffle=True, seed=SEED)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, drop_last=True)

    model = DDP(NeuralMF())
    warm_start_items(model, users, items)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum, n = 0.0, 0
        for u, i, y in loader:
            scores = model(u.flatten(), i.flatten())
            loss = F.binary_cross_entropy_with_logits(scores, y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item()
            n += 1
        stats = torch.tensor([loss_sum, n], dtype=torch.float64)
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch}: bce {stats[0] / stats[1]:.4f}", flush=True)

    if rank == 0:
        os.makedirs(OUT_DIR, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(OUT_DIR, "ncf.pt"))
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
