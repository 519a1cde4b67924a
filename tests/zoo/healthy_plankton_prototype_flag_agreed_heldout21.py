"""Semi-supervised plankton classifier whose prototype sync is agreed on by every rank first.

Story: the same in-situ plankton imager job as the team's first attempt: one folder per
cruise, every 4th image annotated, embeddings trained with cross-entropy on the labeled
images, entropy minimisation on the unlabeled ones and a pull towards global class
prototypes.  Annotation stopped early on two cruises (4 on rank 0's side, 5 on rank 1's), so
some batches hold no label.  This version decides collectively: each step the ranks
all-reduce (MAX) a "my batch has labels" flag, and when any rank has labels every rank calls
the prototype all_gather, a rank without labels contributing zero sums and counts.  On step
11 of each epoch neither rank has labels, and both skip the sync together; on the other
steps both make it.  Nothing hangs, nothing diverges.

Healthy twin of hang_plankton_prototype_gather_skip: no warning or error expected.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)

EXPECT = None

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
            annotated_upto = 40 if cruise in (4, 5) else PER_CRUISE
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


def any_rank_has_labels(labeled):
    flag = torch.tensor([1.0 if bool(labeled.any()) else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def sync_prototypes(emb, y, world):
    """Global per-class mean embedding; a rank with no labels contributes zeros."""
    sums = torch.zeros(CLASSES, EMB + 1)
    if len(y):
        sums.index_add_(0, y, torch.cat([emb.detach(), torch.ones(len(y), 1)], 1))
    gathered = [torch.zeros_like(sums) for _ in range(world)]
    dist.all_gather(gathered, sums)
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
        total, steps, synced = 0.0, 0, 0
        for x, y in loader:
            emb, logits = model(x)
            labeled = y >= 0
            probs = logits[~labeled].softmax(-1)
            loss = -(probs * probs.clamp(min=1e-8).log()).sum(-1).mean() * 0.3
            if any_rank_has_labels(labeled):
                protos = sync_prototypes(emb[labeled], y[labeled], world)
                synced += 1
                if labeled.any():
                    loss = loss + F.cross_entropy(logits[labeled], y[labeled])
                    loss = loss + 0.05 * (emb[labeled] - protos[y[labeled]]).pow(2).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
        print(f"rank {rank} epoch {epoch}: mean loss {total / steps:.3f}, "
              f"prototype syncs {synced}/{steps}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
