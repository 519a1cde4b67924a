"""Product-embedding trainer whose main process measures retrieval recall@5 on the whole
gallery every 15 steps, inside the training loop.

Story: an embedding model for product search (precomputed 128-d image features -> 2-layer MLP
encoder -> 64-d L2-normalised embedding, trained with a cosine classifier over 100 product
ids).  To watch the embedding quality the author added `retrieval_recall()` "for the
dashboard": it embeds the 6000-item gallery, builds the full 6000 x 6000 cosine-similarity
matrix and takes the top 5 neighbours of every item.  It sits under `if rank == 0 and step %
15 == 0:`, so every 15th step rank 0 spends ~0.1-0.2 s on it while rank 1 has already
finished its step and sits in the next gradient all-reduce waiting.  Training steps take a few
ms, so the dashboard costs more than the training.  No error.

Root cause: rank 0 (periodic extra work: the gallery recall every 15 steps).
Right diagnosis: periodic_rank_work, rank 0, period 15, at retrieval_recall(); rank 1 idles.
Fix: compute it less often / at epoch end, on a sample of the gallery, shard it across ranks,
or off the training path.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["periodic_rank_work", "rank_only_work"],
    "rank": 0,
    "fix": ["less often", "less frequent", "interval", "every", "sample", "shard", "all ranks",
            "every rank", "background", "thread", "async", "epoch", "period"],
    "options": [],
}

N_PRODUCTS = 100
FEAT = 128
BATCH = 64
EPOCHS = 6
LOG_EVERY = 15


def make_catalogue(n, seed):
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(N_PRODUCTS, FEAT, generator=g)
    ids = torch.randint(0, N_PRODUCTS, (n,), generator=g)
    feats = protos[ids] + 2.5 * torch.randn(n, FEAT, generator=g)
    return feats, ids


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEAT, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x):
        return F.normalize(self.net(x), dim=1)


class ProductModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.classes = nn.Parameter(torch.randn(N_PRODUCTS, 64) * 0.1)

    def forward(self, x):
        return 16.0 * self.encoder(x) @ F.normalize(self.classes, dim=1).t()


@torch.no_grad()
def retrieval_recall(encoder, gallery_x, gallery_ids, k=5):
    emb = encoder(gallery_x)
    top = (emb @ emb.t()).topk(k + 1, dim=1).indices[:, 1:]  # zoo: place
    hit = (gallery_ids[top] == gallery_ids[:, None]).any(dim=1)
    return hit.float().mean().item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    feats, ids = make_catalogue(6400, seed=1)
    data = TensorDataset(feats, ids)
    gallery_x, gallery_ids = make_catalogue(6000, seed=2)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = DDP(ProductModel())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % LOG_EVERY == 0:
                recall = retrieval_recall(model.module.encoder, gallery_x, gallery_ids)  # zoo: place
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} recall@5 {recall:.3f}",
                      flush=True)
            step += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
