"""Camera-trap species classification on frozen-backbone embeddings, DDP on CPU.

What the job does
    Images from camera traps were embedded once by a frozen backbone (256-d
    vectors, synthesised here); a small MLP head is trained on them for 12
    species with a long-tailed class distribution. After each epoch every rank
    evaluates its DistributedSampler shard of the validation set and the
    per-class recall is pooled with an all_reduce of per-class hit/total
    counts.

Root cause
    `per_class_recall` sizes its count vectors from the labels the rank happened
    to see (`int(targets.max()) + 1`) instead of the number of species. The
    rarest species (pangolin, id 11) occurs only in rank 0's validation shard,
    so rank 0 all_reduces a 2x12 tensor and rank 1 a 2x11 tensor: the
    collective's size differs by rank at the end of epoch 0.

Fix
    Size the vectors by the fixed number of classes (NUM_CLASSES, or
    torch.bincount(..., minlength=NUM_CLASSES)) so every rank contributes the
    same shape.

Observed (plain run)
    rc 1 after ~4 s, at the first per_class_recall (end of epoch 0). Rank 1
    (whose validation shard has no pangolin, so k = 11) aborts in C++:
    "terminate called after throwing an instance of 'gloo::EnforceNotMet' ...
    pair.cc:456] op.preamble.length <= op.nbytes. 24 vs 16. Received data size
    doesn't match expected size. Is there a distributed collective mismatch in
    your code?" -> exit -6 (SIGABRT). Rank 0 (k = 12, pangolins at val indices
    232 and 266) fails in the same dist.all_reduce with "Connection reset by
    peer" and is SIGTERMed; torchrun names rank 1 (SIGABRT) as root cause.
"""
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = {
    "kind": ["collective_mismatch"],
    "rank": 1,
    "fix": ["NUM_CLASSES", "num_classes", "minlength", "fixed size", "number of classes"],
    "options": [],
}

SPECIES = ["roe_deer", "wild_boar", "red_fox", "badger", "hare", "squirrel",
           "marten", "lynx", "wolf", "bear", "otter", "pangolin"]
NUM_CLASSES = len(SPECIES)
EMB_DIM = 256
CLASS_FREQ = torch.tensor([30, 22, 18, 12, 10, 8, 6, 4, 3, 2, 1.5, 0.3])


def embeddings(n, seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(NUM_CLASSES, EMB_DIM, generator=torch.Generator().manual_seed(0)) * 0.6
    y = torch.multinomial(CLASS_FREQ / CLASS_FREQ.sum(), n, replacement=True, generator=g)
    x = centers[y] + torch.randn(n, EMB_DIM, generator=g)
    return x, y


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(EMB_DIM), nn.Linear(EMB_DIM, 128), nn.GELU(),
                                 nn.Dropout(0.2), nn.Linear(128, NUM_CLASSES))

    def forward(self, x):
        return self.mlp(x)


@torch.no_grad()
def per_class_recall(net, loader):
    net.eval()
    preds, targets = [], []
    for x, y in loader:
        preds.append(net(x).argmax(1))
        targets.append(y)
    net.train()
    preds, targets = torch.cat(preds), torch.cat(targets)
    k = int(targets.max()) + 1  # zoo: place
    hits = torch.zeros(k).index_add_(0, targets, (preds == targets).float())
    totals = torch.zeros(k).index_add_(0, targets, torch.ones(len(targets)))
    stats = torch.stack([hits, totals])
    dist.all_reduce(stats)
    return stats[0] / stats[1].clamp(min=1)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(12)
    out_dir = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "camera_trap")
    os.makedirs(out_dir, exist_ok=True)

    x_tr, y_tr = embeddings(8000, seed=1)
    x_va, y_va = embeddings(600, seed=5)
    train_ds, val_ds = TensorDataset(x_tr, y_tr), TensorDataset(x_va, y_va)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=12)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=64, sampler=train_sampler)
    val_loader = DataLoader(val_ds, batch_size=128, sampler=val_sampler)

    # inverse-frequency class weights for the long tail
    weights = (1.0 / CLASS_FREQ) / (1.0 / CLASS_FREQ).mean()
    model = DDP(Head())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for epoch in range(4):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y, weight=weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        recall = per_class_recall(model.module, val_loader)
        if rank == 0:
            worst = recall.argmin().item()
            print(f"epoch {epoch} loss {loss.item():.3f} mean_recall {recall.mean():.3f} "
                  f"worst {SPECIES[worst]} {recall[worst]:.2f}", flush=True)
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(out_dir, "head.pt"))
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
