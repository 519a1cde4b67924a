"""HEALTHY: frozen pretrained encoder + trainable head, DDP with find_unused_parameters=False.

Story: linear-probe style fine-tuning.  `Probe` holds a "pretrained" encoder whose
parameters are frozen with `requires_grad_(False)` (and run under torch.no_grad), plus a
trainable projection and classifier.  DDP is built with the default
find_unused_parameters=False -- this is correct, because DDP only tracks parameters with
requires_grad=True and every one of those is used in every forward.  The learning rate
follows a linear warmup + cosine schedule (LambdaLR), identical on every rank.  The
encoder is put in eval mode after DDP construction (dropout off) -- a module-mode change,
not a parameter change, so nothing diverges.  Exits 0.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None


class Encoder(nn.Module):
    def __init__(self, dim=48):
        super().__init__()
        self.emb = nn.Embedding(600, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 96, dropout=0.1, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, tokens):
        return self.layers(self.emb(tokens)).mean(1)


class Probe(nn.Module):
    def __init__(self, encoder, dim=48, classes=5):
        super().__init__()
        self.encoder = encoder.requires_grad_(False)
        self.proj = nn.Linear(dim, dim)
        self.cls = nn.Linear(dim, classes)

    def forward(self, tokens):
        with torch.no_grad():
            feats = self.encoder(tokens)
        return self.cls(torch.tanh(self.proj(feats)))


def warmup_cosine(total, warmup):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        p = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * p))

    return f


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Probe(Encoder()))
    model.module.encoder.eval()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=2e-3, weight_decay=0.01)
    total = 60
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(total, warmup=10))
    g = torch.Generator().manual_seed(rank)
    for step in range(total):
        tokens = torch.randint(0, 600, (16, 20), generator=g)
        labels = tokens[:, 0] % 5
        loss = F.cross_entropy(model(tokens), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
    cs = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"rank {rank} checksum {cs:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
