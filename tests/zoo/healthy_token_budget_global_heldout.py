"""HEALTHY twin of hang_token_budget_epoch: the token budget is counted globally.

Story: the same token-budgeted epochs over the same interleaved corpus (rank 0 reads the
short news documents, rank 1 the long book excerpts, so the ranks' token counts differ a
lot).  But `Trainer.train_epoch` all-reduces each step's token count and compares the
GLOBAL count with `world * tokens_per_epoch`, so every rank breaks out of the loop at the
same step.  A `break` on a data-dependent condition inside a DDP loop looks dangerous, but
the decision is shared.  Exits 0.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

torch.set_num_threads(1)

EXPECT = None

CONFIG = {"tokens_per_epoch": 4000, "batch_size": 8, "epochs": 2, "max_len": 64, "vocab": 500}


class InterleavedCorpus(Dataset):
    """news (short) and books (long) interleaved round-robin when the corpus was built."""

    def __init__(self, n=400):
        g = torch.Generator().manual_seed(0)
        self.docs = []
        for i in range(n):
            lo, hi = (20, 36) if i % 2 == 0 else (48, 64)
            length = int(torch.randint(lo, hi + 1, (1,), generator=g))
            ids = torch.randint(1, CONFIG["vocab"], (length,), generator=g)
            self.docs.append((ids, int(ids[:3].sum()) % 4))

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i]


def collate(batch):
    tokens = torch.zeros(len(batch), CONFIG["max_len"], dtype=torch.long)
    for row, (ids, _) in enumerate(batch):
        tokens[row, : len(ids)] = ids
    return tokens, torch.tensor([label for _, label in batch])


class MeanPoolLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(CONFIG["vocab"], 64, padding_idx=0)
        self.mix = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, tokens):
        mask = (tokens != 0).float().unsqueeze(-1)
        h = (self.emb(tokens) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.mix(h)


class Trainer:
    def __init__(self, rank):
        self.rank = rank
        self.world = dist.get_world_size()
        torch.manual_seed(0)
        self.model = DDP(MeanPoolLM())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        corpus = InterleavedCorpus()
        self.sampler = DistributedSampler(corpus, shuffle=False)  # corpus is pre-shuffled
        self.loader = DataLoader(corpus, batch_size=CONFIG["batch_size"], sampler=self.sampler,
                                 collate_fn=collate)

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        seen, steps = 0, 0
        for tokens, labels in self.loader:
            loss = F.cross_entropy(self.model(tokens), labels)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            steps += 1
            step_tokens = torch.tensor([int((tokens != 0).sum())], dtype=torch.long)
            dist.all_reduce(step_tokens)
            seen += int(step_tokens)
            if seen >= self.world * CONFIG["tokens_per_epoch"]:
                break
        return steps, loss.item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer = Trainer(rank)
    for epoch in range(CONFIG["epochs"]):
        steps, loss = trainer.train_epoch(epoch)
        print(f"rank {rank} epoch {epoch}: {steps} steps, loss {loss:.3f}", flush=True)
        dist.barrier()
        if rank == 0:
            torch.save(trainer.model.module.state_dict(), f"/tmp/token_budget_global_epoch{epoch}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
