"""Customer-support ticket routing (billing / outage / account / hardware / other).

A convolutional encoder with a mean-of-embeddings side path classifies tokenised
ticket texts of variable length. The learning rate follows the number of real (non-padding)
tokens per optimisation step with a linear warmup, so long-ticket batches take larger
steps than short ones.

Healthy: the token count that drives the learning rate is all_reduce'd (summed over
ranks and averaged) before the scheduler sees it, so every rank computes exactly the
same learning rate at every step and applies it to the same all-reduced gradient. The
replicas stay bit-identical.

Fix: none needed.

Observed (plain run): exit 0 in ~5 s; train accuracy 0.29 -> 0.76 -> 0.94, lr ~0.043.
Checked separately: parameters, SGD momentum buffers and the learning rate are bit-identical
on both ranks at the end (max |diff| 0).
"""
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

VOCAB, MAX_LEN, N_QUEUES, PAD = 800, 80, 5, 0
HP = {"emb": 48, "batch": 32, "epochs": 3, "base_lr": 0.04, "ref_tokens": 32 * 40, "warmup": 15}


def synth_tickets(n, seed):
    g = torch.Generator().manual_seed(seed)
    queue = torch.randint(0, N_QUEUES, (n,), generator=g)
    lengths = torch.randint(6, MAX_LEN + 1, (n,), generator=g)
    toks = torch.randint(1, VOCAB, (n, MAX_LEN), generator=g)
    # each queue has its own block of "topic" words that appear with some probability
    topic = 1 + queue[:, None] * 40 + torch.randint(0, 40, (n, MAX_LEN), generator=g)
    use_topic = torch.rand(n, MAX_LEN, generator=g) < 0.25
    toks = torch.where(use_topic, topic, toks)
    toks = toks * (torch.arange(MAX_LEN)[None, :] < lengths[:, None])
    return toks, queue


class TicketEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HP["emb"], padding_idx=PAD)
        self.conv = nn.Conv1d(HP["emb"], 64, kernel_size=3, padding=1)
        self.cls = nn.Linear(64 + HP["emb"], N_QUEUES)

    def forward(self, toks):
        mask = (toks != PAD).float()
        e = self.emb(toks)
        mean_emb = (e * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
        h = self.conv(e.transpose(1, 2)).relu()
        h = h.masked_fill(mask[:, None, :] == 0, -1e4).amax(2)
        return self.cls(torch.cat([h, mean_emb], dim=1))


class TokenProportionalLR:
    def __init__(self, optimizer, base_lr, ref_tokens, warmup):
        self.optimizer, self.base_lr, self.ref_tokens, self.warmup = optimizer, base_lr, ref_tokens, warmup
        self.n = 0

    def step(self, n_tokens):
        self.n += 1
        lr = self.base_lr * min(1.0, self.n / self.warmup) * float(n_tokens) / self.ref_tokens
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr


def global_token_count(toks):
    n = (toks != PAD).sum().to(torch.float64)
    dist.all_reduce(n)
    return n.item() / dist.get_world_size()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(99 + rank)

    toks, queue = synth_tickets(2400, seed=31)
    ds = TensorDataset(toks, queue)
    sampler = DistributedSampler(ds, shuffle=True, seed=31)
    loader = DataLoader(ds, batch_size=HP["batch"], sampler=sampler, drop_last=True)

    model = DDP(TicketEncoder())
    optimizer = torch.optim.SGD(model.parameters(), lr=HP["base_lr"], momentum=0.9)
    schedule = TokenProportionalLR(optimizer, HP["base_lr"], HP["ref_tokens"], HP["warmup"])

    for epoch in range(HP["epochs"]):
        sampler.set_epoch(epoch)
        correct = torch.zeros(2)
        for tb, yb in loader:
            lr = schedule.step(global_token_count(tb))
            logits = model(tb)
            loss = F.cross_entropy(logits, yb, label_smoothing=0.05)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            correct += torch.tensor([(logits.argmax(1) == yb).sum().item(), len(yb)])
        dist.all_reduce(correct)
        if rank == 0:
            print(f"epoch {epoch}: train acc {correct[0] / correct[1]:.3f} lr {lr:.4f}", flush=True)

    if rank == 0:
        out = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
        os.makedirs(out, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(out, "ticketrouting_heldout29.pt"))
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
