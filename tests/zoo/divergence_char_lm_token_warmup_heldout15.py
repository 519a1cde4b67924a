"""Character-level language model (embedding + GRU) on padded variable-length "words", with a
linear warmup measured in tokens, as large LM recipes do. No error, no hang, yet the replicas
end with different weights: the warmup counter adds up the non-pad tokens of the rank's own
batches only, and the two ranks' batches hold different numbers of real tokens, so every step
of the warmup the ranks set a different learning rate in param_group["lr"] and apply the same
averaged gradient with different step sizes."""

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
    "names": [["learning rate", "lr ", "lr=", "'lr'", "warmup", "scheduler"]],
    "never": [],
}

VOCAB, PAD, MAX_LEN = 28, 0, 16


def make_words(n: int, seed: int) -> TensorDataset:
    """Words from a tiny bigram 'language'; index 0 is padding, 1 is end-of-word."""
    g = torch.Generator().manual_seed(seed)
    trans = torch.softmax(3.0 * torch.randn(VOCAB, VOCAB, generator=g), 1)
    trans[:, PAD] = 0.0
    tokens = torch.full((n, MAX_LEN), PAD, dtype=torch.long)
    lengths = torch.randint(3, MAX_LEN + 1, (n,), generator=g)
    for i in range(n):
        c = torch.randint(2, VOCAB, (1,), generator=g)
        for t in range(lengths[i]):
            tokens[i, t] = c
            c = torch.multinomial(trans[c].squeeze(0), 1, generator=g)
    return TensorDataset(tokens)


class CharLM(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.rnn = nn.GRU(dim, hidden, batch_first=True)
        self.out = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(tokens))
        return self.out(h)


class TokenWarmup:
    """lr ramps linearly from 0 to peak over the first `warmup_tokens` real tokens."""

    def __init__(self, opt: torch.optim.Optimizer, peak_lr: float, warmup_tokens: int) -> None:
        self.opt, self.peak_lr, self.warmup_tokens = opt, peak_lr, warmup_tokens
        self.tokens_seen = 0

    def step(self, n_tokens: int) -> None:
        self.tokens_seen += n_tokens
        lr = self.peak_lr * min(1.0, self.tokens_seen / self.warmup_tokens)
        for group in self.opt.param_groups:
            group["lr"] = lr  # zoo: place


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    data = make_words(1024, seed=5)
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = DDP(CharLM())
    opt = torch.optim.Adam(model.parameters(), lr=0.0)
    warmup = TokenWarmup(opt, peak_lr=3e-3, warmup_tokens=6000)

    for epoch in range(3):
        sampler.set_epoch(epoch)
        for step, (tokens,) in enumerate(loader):
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            mask = targets != PAD
            warmup.step(int(mask.sum()))
            logits = model(inputs)
            loss = nn.functional.cross_entropy(logits[mask], targets[mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} lr {opt.param_groups[0]['lr']:.2e}", flush=True)

    checksum = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"[rank {rank}] tokens seen {warmup.tokens_seen}, final weight checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
