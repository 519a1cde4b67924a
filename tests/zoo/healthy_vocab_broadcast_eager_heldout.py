"""HEALTHY twin of hang_lazy_vocab_broadcast: the shared vocabulary is built on every rank.

Story: the same `Vocab` whose `itos` property broadcasts rank 0's table with
`dist.broadcast_object_list` on first access, and the same rank-0-only sample logger that
decodes a batch every 10 steps.  But right after creating the vocab, every rank touches
`vocab.itos` once ("warm the cache on all ranks"), so the broadcast is a collective every
rank issues, before the loop; afterwards rank 0's decode only reads the cached table.  A
rank-0-only block calling a method that contains a collective looks dangerous, but is
correct.  Exits 0.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None

VOCAB_SIZE = 200


class Vocab:
    def __init__(self, rank):
        self.rank = rank

    def _build_from_files(self):
        return [f"tok{i}" for i in range(VOCAB_SIZE)]

    @functools.cached_property
    def itos(self):
        payload = [self._build_from_files()] if self.rank == 0 else [None]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def decode(self, ids):
        return " ".join(self.itos[i] for i in ids)


class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB_SIZE, 48, mode="mean")
        self.head = nn.Sequential(nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 3))

    def forward(self, ids):
        return self.head(self.emb(ids))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    vocab = Vocab(rank)
    assert len(vocab.itos) == VOCAB_SIZE  # every rank joins the broadcast once, here
    torch.manual_seed(0)
    model = DDP(BagClassifier())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB_SIZE, (1200, 12), generator=g)
    labels = ids[:, 0] % 3
    data = TensorDataset(ids, labels)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=20, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 10 == 0 and step > 0:
                sample = vocab.decode(x[0].tolist())
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} | {sample[:40]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
