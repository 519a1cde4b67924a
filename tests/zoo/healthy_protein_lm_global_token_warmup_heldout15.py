"""Healthy twin: next-residue model (embedding + LSTM) on padded protein fragments of varying
length, with a learning-rate warmup and cosine decay measured in tokens. The two ranks' batches
hold different numbers of real residues, so every step the non-pad token count is all-reduced
before it is added to the schedule's counter: each rank advances the schedule by the same global
count and writes the same value into param_group["lr"], and the replicas stay identical."""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

AMINO = 20
PAD, VOCAB, MAX_LEN = 0, AMINO + 1, 20


def make_fragments(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    motifs = torch.randint(1, VOCAB, (6, 5), generator=g)
    seqs = torch.full((n, MAX_LEN), PAD, dtype=torch.long)
    lengths = torch.randint(6, MAX_LEN + 1, (n,), generator=g)
    for i in range(n):
        L = int(lengths[i])
        frag = torch.randint(1, VOCAB, (L,), generator=g)
        m = motifs[int(torch.randint(0, 6, (1,), generator=g))]
        start = int(torch.randint(0, L - 4, (1,), generator=g))
        frag[start:start + 5] = m[: L - start][:5]
        seqs[i, :L] = frag
    return TensorDataset(seqs)


class ResidueLM(nn.Module):
    def __init__(self, dim: int = 24, hidden: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, seqs: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(seqs))[0])


class TokenSchedule:
    def __init__(self, opt, peak_lr: float, warmup_tokens: int, total_tokens: int) -> None:
        self.opt, self.peak_lr = opt, peak_lr
        self.warmup_tokens, self.total_tokens = warmup_tokens, total_tokens
        self.tokens_seen = 0

    def step(self, local_tokens: int) -> float:
        count = torch.tensor([local_tokens], dtype=torch.long)
        dist.all_reduce(count)
        self.tokens_seen += int(count)
        if self.tokens_seen < self.warmup_tokens:
            lr = self.peak_lr * self.tokens_seen / self.warmup_tokens
        else:
            frac = min(1.0, (self.tokens_seen - self.warmup_tokens) / (self.total_tokens - self.warmup_tokens))
            lr = 0.5 * self.peak_lr * (1 + math.cos(math.pi * frac))
        for group in self.opt.param_groups:
            group["lr"] = lr
        return lr


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    data = make_fragments(1024, seed=13)
    sampler = DistributedSampler(data, shuffle=True, seed=6)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = DDP(ResidueLM())
    opt = torch.optim.Adam(model.parameters(), lr=0.0)
    sched = TokenSchedule(opt, peak_lr=4e-3, warmup_tokens=10_000, total_tokens=45_000)

    for epoch in range(3):
        sampler.set_epoch(epoch)
        for step, (seqs,) in enumerate(loader):
            inputs, targets = seqs[:, :-1], seqs[:, 1:]
            mask = targets != PAD
            lr = sched.step(int(mask.sum()))
            loss = nn.functional.cross_entropy(model(inputs)[mask], targets[mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} lr {lr:.2e}", flush=True)

    checksum = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"[rank {rank}] tokens seen {sched.tokens_seen}, final weight checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
