"""Music-genre classifier with a home-made genre-balanced sampler, reshuffled every epoch.

Story: the genre classifier on 64-d preview embeddings, whose catalogue is skewed (a few
genres dominate).  The team wrote `GenreBalancedSampler`: each epoch it shuffles the previews
of every genre with a generator seeded by `seed + epoch`, deals them round-robin across
genres so the rare genres are spread over the whole epoch instead of clumping, pads the list
to a multiple of the world size and gives each rank every world-th entry.  It is not a
DistributedSampler, but it has the same contract: `set_epoch(epoch)` is called at the top
of every epoch, so each epoch deals new orders and new batch compositions, identical in
length on every rank.

Healthy twin of silent_genre_resume_set_epoch_once: no warning or error expected.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None

GENRES = 8
EPOCHS = 6


def previews(n=2048):
    g = torch.Generator().manual_seed(31)
    centers = torch.randn(GENRES, 64, generator=g)
    skew = torch.tensor([6.0, 4.0, 3.0, 2.0, 1.0, 1.0, 0.5, 0.5])
    genre = torch.multinomial(skew, n, replacement=True, generator=g)
    emb = centers[genre] * 0.6 + torch.randn(n, 64, generator=g)
    return TensorDataset(emb, genre)


class GenreBalancedSampler(Sampler):
    def __init__(self, labels, rank, world, seed=0):
        self.labels, self.rank, self.world, self.seed = labels, rank, world, seed
        self.epoch = 0
        self.num_samples = math.ceil(len(labels) / world)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        queues = []
        for c in range(GENRES):
            idx = (self.labels == c).nonzero().flatten()
            queues.append(idx[torch.randperm(len(idx), generator=g)].tolist())
        order = []
        for k in range(max(len(q) for q in queues)):
            order += [q[k] for q in queues if k < len(q)]
        total = self.num_samples * self.world
        order += order[: total - len(order)]
        return iter(order[self.rank:total:self.world])

    def __len__(self):
        return self.num_samples


class GenreHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.2),
                                 nn.Linear(128, GENRES))

    def forward(self, x):
        return self.net(x)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(GenreHead())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)

    data = previews()
    sampler = GenreBalancedSampler(data.tensors[1], rank, world, seed=17)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        first = list(iter(sampler))[:5]
        correct, seen = 0, 0
        for x, y in loader:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct += (logits.argmax(-1) == y).sum().item()
            seen += len(y)
        print(f"rank {rank} epoch {epoch}: acc {correct / seen:.3f}, first samples {first}",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
