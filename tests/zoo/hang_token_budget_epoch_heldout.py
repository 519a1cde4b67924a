"""Each rank counts its OWN tokens against the per-epoch token budget and leaves early (hang).

Story: an LM-style classifier trains "epochs" of a fixed token budget (`tokens_per_epoch`),
a common recipe when documents have very different lengths.  The corpus was built by
interleaving two sources round-robin (news, books) and is read without shuffling through a
DistributedSampler, so rank 0 gets all the short news documents and rank 1 all the long
book excerpts.  `Trainer.train_epoch` adds the batch's real (unpadded) token count to a
rank-local counter and `break`s when the counter passes the budget.  Rank 1 reaches the
budget after 9 steps, leaves the loop and waits in the end-of-epoch `dist.barrier()`; rank
0 still has budget left and enters step 9's gradient all-reduce, which no one joins.  Hang.

Root cause: rank 1 (it left the training loop early on a rank-local decision).
Right diagnosis: rank 1 left the loop (the `break` on its own token count) and sits in the
epoch-end barrier while rank 0 waits in the gradient all-reduce of the next step.
Fix: make the stop decision global: all-reduce the token count (or the stop flag) every
step so all ranks break at the same step, or budget in steps instead of local tokens.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["all_reduce", "allreduce", "all-reduce", "broadcast", "every rank", "all ranks",
            "agree", "same step", "same number", "global", "together"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

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
            seen += int((tokens != 0).sum())
            if seen >= CONFIG["tokens_per_epoch"]:
                break  # zoo: place
        return steps, loss.item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer = Trainer(rank)
    for epoch in range(CONFIG["epochs"]):
        steps, loss = trainer.train_epoch(epoch)
        print(f"rank {rank} epoch {epoch}: {steps} steps, loss {loss:.3f}", flush=True)
        dist.barrier()  # zoo: place
        if rank == 0:
            torch.save(trainer.model.module.state_dict(), f"/tmp/token_budget_epoch{epoch}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
