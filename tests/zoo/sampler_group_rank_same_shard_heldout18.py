"""A DistributedSampler built with the node's rank instead of the process's: same shard everywhere.

Story: a sentiment classifier's data module builds its own DistributedSampler from
environment variables "so it also works without an initialised process group".  The author
read the rank from GROUP_RANK -- which torchrun sets to the rank of the *node* (the agent's
group), 0 for every process of a single-node job -- and the world size from WORLD_SIZE.  So
both ranks build `DistributedSampler(num_replicas=2, rank=0)`: each reads the same half of
the dataset, in the same order, and the other half is never seen.  No error; the job trains
at half the data and each step's gradient average is over duplicated batches.

Root cause: the sampler's rank (no single rank at fault: every rank built it with rank 0).
Fix: pass the process rank (`rank=dist.get_rank()`, or the RANK variable) to the
DistributedSampler, or leave rank/num_replicas out so it asks the process group.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["missing_distributed_sampler"],
    "rank": None,
    "fix": ["rank", "get_rank", "RANK"],
    "options": [],
}


class ReviewData:
    """Synthetic bag-of-token reviews, split and sharded for distributed training."""

    def __init__(self, n=3000, vocab=300, length=20, seed=7):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.tokens = torch.randint(0, vocab, (n, length), generator=g)
        self.tokens[:, :4] = self.labels[:, None] * 150 + torch.randint(0, 150, (n, 4), generator=g)

    def train_loader(self, batch_size):
        world = int(os.environ.get("WORLD_SIZE", 1))
        rank = int(os.environ.get("GROUP_RANK", 0))
        dataset = TensorDataset(self.tokens, self.labels)
        self.sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)  # zoo: place
        return DataLoader(dataset, batch_size=batch_size, sampler=self.sampler)


class BagClassifier(nn.Module):
    def __init__(self, vocab=300, dim=32):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.out = nn.Linear(dim, 2)

    def forward(self, tokens):
        return self.out(torch.tanh(self.emb(tokens)))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(BagClassifier())
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    data = ReviewData()
    loader = data.train_loader(batch_size=50)

    for epoch in range(3):
        data.sampler.set_epoch(epoch)
        correct = seen = 0
        for tokens, labels in loader:
            logits = model(tokens)
            loss = F.cross_entropy(logits, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct += int((logits.argmax(1) == labels).sum())
            seen += len(labels)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} train acc {correct / seen:.3f}", flush=True)

    dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/review_bag.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
