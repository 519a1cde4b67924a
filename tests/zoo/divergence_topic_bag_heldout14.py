"""Topic classifier over bags of token ids. Every step's gradients are averaged by DDP, yet the
embedding table drifts apart between the ranks without any error: the table caps each row's norm
(``max_norm``), and that renormalisation rewrites, in place and inside the forward, exactly the
rows of the tokens that rank's own batch looked up. Each rank rewrites different rows."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": [],
    "options": [],
    "names": ["embed.weight"],
    "never": ["loaded after wrapping"],
}

VOCAB, SEQ, TOPICS = 400, 24, 4


def make_corpus(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, TOPICS, (n,), generator=g)
    tokens = torch.randint(TOPICS * 20, VOCAB, (n, SEQ), generator=g)
    # each topic has 20 marker tokens; a document carries a few of its topic's markers
    markers = labels[:, None] * 20 + torch.randint(0, 20, (n, 6), generator=g)
    tokens[:, :6] = markers
    return TensorDataset(tokens, labels)


class BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32, max_norm=1.0)
        self.hidden = nn.Linear(32, 64)
        self.out = nn.Linear(64, TOPICS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        doc = self.embed(ids).mean(dim=1)
        return self.out(torch.relu(self.hidden(doc)))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    train = make_corpus(512, seed=1)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=16, sampler=sampler)

    model = DDP(BagOfWords())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    for epoch in range(3):
        sampler.set_epoch(epoch)
        total, correct, seen = 0.0, 0, 0
        for ids, y in loader:
            opt.zero_grad()
            logits = model(ids)
            loss = nn.functional.cross_entropy(logits, y)
            loss.backward()
            opt.step()
            total += loss.item() * len(y)
            correct += int((logits.argmax(1) == y).sum())
            seen += len(y)
        if rank == 0:
            print(f"epoch {epoch}: loss {total / seen:.3f} acc {correct / seen:.3f}", flush=True)

    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/topic_bag.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
