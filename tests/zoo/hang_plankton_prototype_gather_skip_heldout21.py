"""Semi-supervised plankton model: rank 1 skips the prototype all_gather on an unlabeled batch.

Story: an in-situ plankton imager produces one folder per cruise; a small fraction of each
cruise (every 4th image) was annotated by a taxonomist, the rest is unlabeled.  The model is
trained semi-supervised on pre-computed image embeddings: cross-entropy on the labeled images,
entropy minimisation on the unlabeled ones, and a prototype term that pulls each labeled
embedding towards its class prototype.  The prototypes are global: each step every rank sums
its labeled embeddings per class and `sync_prototypes` all-gathers those sums.  The helper is
only called `if labeled.any()`, which was always true, because every batch of 16 holds 4
annotated images... except on cruise 5, whose annotation stopped after 40 images.  Rank 1
reads cruises 1, 3, 5, 7 in acquisition order; its step 11 batch (cruise 5, images 48-63) has
no label, so rank 1 skips the all_gather and goes straight to backward (DDP's gradient
all-reduce), while rank 0, whose batch has labels, waits in the all_gather.  Different
collectives on the two ranks: the job hangs with no error.

Root cause: rank 1, which went past the `dist.all_gather` in `sync_prototypes` that every
earlier step made (data-dependent branch `if labeled.any():`).
Fix: call the all_gather on every rank every step (contribute zero sums and counts when the
batch holds no labels), or agree on the branch collectively (all_reduce the flag first).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["rank_only_collective", "collective_mismatch"],
    "rank": 1,
    "fix": ["every rank", "all ranks", "each rank", "every step", "unconditional", "zero",
            "zeros", "agree", "all_reduce", "collectively", "same branch", "outside the",
            "both ranks", "always"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
    "names": [["all_gather", "allgather"]],
}

CLASSES = 6
DIM = 48
EMB = 24
PER_CRUISE = 64


class CruiseEmbeddings(Dataset):
    """Embeddings of one rank's cruises, in acquisition order; label -1 = not annotated."""

    def __init__(self, cruises):
        centers = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(7)) * 2
        self.x, self.y = [], []
        for cruise in cruises:
            g = torch.Generator().manual_seed(100 + cruise)
            taxa = torch.randint(0, CLASSES, (PER_CRUISE,), generator=g)
            feats = centers[taxa] + torch.randn(PER_CRUISE, DIM, generator=g)
            annotated_upto = 40 if cruise == 5 else PER_CRUISE  # cruise 5: annotation unfinished
            for i in range(PER_CRUISE):
                labeled = i % 4 == 0 and i < annotated_upto
                self.x.append(feats[i])
                self.y.append(int(taxa[i]) if labeled else -1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class ProtoNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(DIM, 96), nn.ReLU(), nn.Linear(96, EMB))
        self.head = nn.Linear(EMB, CLASSES)

    def forward(self, x):
        emb = self.encoder(x)
        return emb, self.head(emb)


def sync_prototypes(emb, y, world):
    """Global per-class mean embedding from every rank's labeled images."""
    sums = torch.zeros(CLASSES, EMB + 1)
    sums.index_add_(0, y, torch.cat([emb.detach(), torch.ones(len(y), 1)], 1))
    gathered = [torch.zeros_like(sums) for _ in range(world)]
    dist.all_gather(gathered, sums)  # zoo: place
    total = torch.stack(gathered).sum(0)
    return total[:, :EMB] / total[:, EMB:].clamp(min=1)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(ProtoNet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)

    data = CruiseEmbeddings(cruises=range(rank, 8, world))
    loader = DataLoader(data, batch_size=16, shuffle=False)
    for epoch in range(3):
        total, steps = 0.0, 0
        for x, y in loader:
            emb, logits = model(x)
            labeled = y >= 0
            probs = logits[~labeled].softmax(-1)
            loss = -(probs * probs.clamp(min=1e-8).log()).sum(-1).mean() * 0.3
            if labeled.any():
                protos = sync_prototypes(emb[labeled], y[labeled], world)
                loss = loss + F.cross_entropy(logits[labeled], y[labeled])
                loss = loss + 0.05 * (emb[labeled] - protos[y[labeled]]).pow(2).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
        print(f"rank {rank} epoch {epoch}: mean loss {total / steps:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
