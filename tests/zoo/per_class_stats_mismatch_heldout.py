"""Per-class accuracy for the training log. `ClassStats` keeps a dict keyed by the classes the
rank has actually seen in the current window, and every `log_every` steps `ClassStats.reduce`
packs it into a tensor and sums it over the ranks with `dist.all_reduce`. The first windows
hold the four common classes on both ranks (4 x 2 tensors, the reductions match). Class 4 is
rare (three records) and, with this sampler seed, all three land in rank 1's shard, in its
third window: at step 15 rank 1 reduces a 5 x 2 tensor while rank 0 reduces a 4 x 2 one. The
same op at the same sequence number with different sizes: gloo aborts rank 0 with SIGABRT
("Received data size doesn't match expected size. 24 vs 16"), and rank 1 either aborts the
same way or gets "Connection reset by peer"; on NCCL it would hang or corrupt.

A right diagnosis: a collective whose tensor size differs by rank, at the marked
`dist.all_reduce` in `ClassStats.reduce`; root rank 1, whose call parted from the shape every
earlier call had (5 entries instead of 4), though rank 0 is the first to die: its abort is the
gloo size check catching rank 1's bigger message, a consequence. Fix: reduce
a fixed-size tensor over all classes (num_classes, zero-filled) on every rank, the same shape
and dtype everywhere."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": None,  # two ranks with different sizes: neither side alone is the cause
    "fix": ["same size", "same shape", "fixed size", "fixed-size", "num_classes", "shape",
            "size", "every rank", "all ranks", "pad"],
    "names": ["all_reduce"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

HP = {"n": 240, "dim": 10, "common_classes": 4, "rare_ids": [105, 198, 218], "bs": 8, "lr": 0.05,
      "epochs": 2, "seed": 8,
      "log_every": 5}


def dataset(hp):
    g = torch.Generator().manual_seed(hp["seed"])
    x = torch.randn(hp["n"], hp["dim"], generator=g)
    y = torch.randint(0, hp["common_classes"], (hp["n"],), generator=g)
    y[hp["rare_ids"]] = hp["common_classes"]  # the rare class
    x[hp["rare_ids"]] += 2.0
    return TensorDataset(x, y)


class ClassStats:
    def __init__(self):
        self.table = {}

    def update(self, logits, y):
        pred = logits.argmax(1)
        for cls in y.unique().tolist():
            mask = y == cls
            hit, seen = self.table.get(cls, (0, 0))
            self.table[cls] = (hit + int((pred[mask] == cls).sum()), seen + int(mask.sum()))

    def reduce(self):
        keys = sorted(self.table)
        packed = torch.tensor([list(self.table[k]) for k in keys], dtype=torch.int64)
        dist.all_reduce(packed)  # zoo: place
        return {k: (int(h), int(s)) for k, (h, s) in zip(keys, packed)}

    def reset(self):
        self.table = {}


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hp = HP
    ds = dataset(hp)
    sampler = DistributedSampler(ds, shuffle=True, seed=hp["seed"])
    loader = DataLoader(ds, batch_size=hp["bs"], sampler=sampler)
    torch.manual_seed(hp["seed"])
    n_cls = hp["common_classes"] + 1
    model = DDP(nn.Sequential(nn.Linear(hp["dim"], 32), nn.ReLU(), nn.Linear(32, n_cls)))
    opt = torch.optim.SGD(model.parameters(), lr=hp["lr"])
    stats = ClassStats()
    step = 0
    for epoch in range(hp["epochs"]):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            logits = model(x)
            nn.functional.cross_entropy(logits, y).backward()
            opt.step()
            stats.update(logits.detach(), y)
            step += 1
            if step % hp["log_every"] == 0:
                per_class = stats.reduce()
                stats.reset()
                if rank == 0:
                    line = ", ".join(f"{k}: {h / max(s, 1):.2f}" for k, (h, s) in per_class.items())
                    print(f"step {step} per-class acc {line}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
