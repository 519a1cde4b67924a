"""Healthy twin: the topic classifier over bags of token ids, with per-rank random token
augmentation. Each rank seeds its own generator (so the ranks start from different initial
weights, which DDP's constructor overwrites with rank 0's) and randomly masks and swaps tokens
of its *inputs* only. A max-norm constraint on the embedding rows is applied after every
optimizer step to the whole table, identically on every rank. The replicas stay identical."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

VOCAB, SEQ, TOPICS, UNK = 400, 24, 4, 0


def make_corpus(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, TOPICS, (n,), generator=g)
    tokens = torch.randint(TOPICS * 20, VOCAB, (n, SEQ), generator=g)
    markers = labels[:, None] * 20 + torch.randint(1, 20, (n, 6), generator=g)
    tokens[:, :6] = markers
    return TensorDataset(tokens, labels)


class TokenNoise:
    """Masks a fraction of tokens to UNK and swaps neighbouring tokens at random."""

    def __init__(self, p_mask: float, p_swap: float, generator: torch.Generator) -> None:
        self.p_mask, self.p_swap, self.g = p_mask, p_swap, generator

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.clone()
        ids[torch.rand(ids.shape, generator=self.g) < self.p_mask] = UNK
        swap = torch.rand(ids.shape[0], generator=self.g) < self.p_swap
        pos = torch.randint(0, SEQ - 1, (ids.shape[0],), generator=self.g)
        rows = swap.nonzero().flatten()
        a, b = ids[rows, pos[rows]].clone(), ids[rows, pos[rows] + 1].clone()
        ids[rows, pos[rows]], ids[rows, pos[rows] + 1] = b, a
        return ids


class BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32, padding_idx=UNK)
        self.hidden = nn.Linear(32, 64)
        self.out = nn.Linear(64, TOPICS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        doc = self.embed(ids).mean(dim=1)
        return self.out(torch.relu(self.hidden(doc)))


@torch.no_grad()
def cap_row_norms(embedding: nn.Embedding, max_norm: float) -> None:
    embedding.weight.renorm_(2, 0, max_norm)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)  # different augmentation on every rank
    augment = TokenNoise(0.1, 0.3, torch.Generator().manual_seed(2000 + rank))

    train = make_corpus(512, seed=1)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=16, sampler=sampler)

    model = DDP(BagOfWords())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    for epoch in range(3):
        sampler.set_epoch(epoch)
        total, correct, seen = 0.0, 0, 0
        for ids, y in loader:
            ids = augment(ids)
            opt.zero_grad()
            logits = model(ids)
            loss = nn.functional.cross_entropy(logits, y)
            loss.backward()
            opt.step()
            cap_row_norms(model.module.embed, 1.0)
            total += loss.item() * len(y)
            correct += int((logits.argmax(1) == y).sum())
            seen += len(y)
        if rank == 0:
            print(f"epoch {epoch}: loss {total / seen:.3f} acc {correct / seen:.3f}", flush=True)

    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/topic_bag_aug.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
