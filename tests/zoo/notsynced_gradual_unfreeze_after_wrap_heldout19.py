"""Gradual unfreezing after the DDP wrapper was built: the backbone trains unsynchronised.

Story: a review-sentiment classifier fine-tuned ULMFiT-style.  The "pretrained" backbone
(token embedding + convolutional encoder, built from the same seed on every rank) is frozen
for the first epoch so that only the new classifier head trains (a linear-probe warm-up),
then `Unfreezer.step(epoch)` turns `requires_grad` back on for the backbone and adds its
parameters to the optimizer as a new parameter group with a smaller learning rate.  The
model was wrapped in DDP at the start, while the backbone was frozen, and DDP only puts the
parameters that required grad at construction into its gradient buckets.  From epoch 1 on
each rank's backbone gets gradients from its own batches only, the optimizer applies them,
and the replicas drift apart without any error or warning; the head is still synchronised,
which hides it in the loss curve.

Root cause: no single rank; `requires_grad_(True)` on the backbone after DDP construction
(`embed.weight`, `encoder.*` are in no gradient bucket).
Fix: rebuild the DDP wrapper after unfreezing (`model = DDP(model.module)`), or build DDP with
every parameter trainable and freeze by zeroing the learning rate / skipping the optimizer
group instead.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = {
    "kind": ["gradients_not_synced", "weights_diverged"],
    "rank": None,
    "fix": ["rebuild", "re-wrap", "rewrap", "wrap again", "new DDP", "DDP(", "before wrapping",
            "before DDP", "unfreeze before", "after unfreezing"],
    "names": [["embed", "encoder"]],
    "options": [],
}

VOCAB = 800
SEQ = 40


def reviews(n=3072):
    g = torch.Generator().manual_seed(21)
    label = torch.randint(0, 2, (n,), generator=g)
    tokens = torch.randint(10, VOCAB, (n, SEQ), generator=g)
    # sentiment words: 1-4 positive, 5-9 negative, sprinkled in
    cue = torch.where(label[:, None] == 1, torch.randint(1, 5, (n, SEQ), generator=g),
                      torch.randint(5, 10, (n, SEQ), generator=g))
    mask = torch.rand(n, SEQ, generator=g) < 0.15
    return torch.where(mask, cue, tokens), label


class Backbone(nn.Module):
    def __init__(self, dim=48):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.encoder = nn.Sequential(nn.Conv1d(dim, dim, 5, padding=2), nn.ReLU(),
                                     nn.Conv1d(dim, dim, 5, padding=2), nn.ReLU())

    def forward(self, tokens):
        return self.encoder(self.embed(tokens).transpose(1, 2)).amax(-1)


class SentimentNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(48, 2))

    def forward(self, tokens):
        return self.head(self.backbone(tokens))


class Unfreezer:
    def __init__(self, module, optimizer, at_epoch, lr):
        self.module, self.optimizer, self.at_epoch, self.lr = module, optimizer, at_epoch, lr
        for p in module.parameters():
            p.requires_grad_(False)

    def step(self, epoch):
        if epoch != self.at_epoch:
            return False
        params = list(self.module.parameters())
        for p in params:
            p.requires_grad_(True)  # zoo: place
        self.optimizer.add_param_group({"params": params, "lr": self.lr})
        return True


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # stands in for the pretrained checkpoint: same weights everywhere
    net = SentimentNet()
    opt = torch.optim.AdamW(net.head.parameters(), lr=3e-3)
    unfreezer = Unfreezer(net.backbone, opt, at_epoch=1, lr=5e-4)
    model = DDP(net)
    torch.manual_seed(100 + rank)  # dropout masks differ per rank

    tokens, labels = reviews()
    data = TensorDataset(tokens, labels)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        if unfreezer.step(epoch) and rank == 0:
            print(f"epoch {epoch}: backbone unfrozen", flush=True)
        model.train()
        correct = 0
        for x, y in loader:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct += (logits.argmax(-1) == y).sum().item()
        if rank == 0:
            print(f"epoch {epoch}: train acc {correct / len(sampler):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
