"""Validation metrics are summed across ranks with one all_reduce per metric, iterating over a
Python set of metric names. A set of strings iterates in hash order, and the two ranks run with
different PYTHONHASHSEED (as two hosts with different shell profiles would; pinned per rank below
so the job does the same thing every time): rank 0 reduces loss, top1, recall, confusion and
rank 1 top1, loss, confusion, recall. The first two reduces silently add the wrong metrics
together; the third pairs recall (4 values) with confusion (16) and the job fails there. The
root is the set's order at the loop, not the size mismatch."""

import os
import sys

HASH_SEED = {"0": "14", "1": "17"}
_seed = HASH_SEED.get(os.environ.get("RANK", ""))
if _seed is not None and os.environ.get("PYTHONHASHSEED") != _seed:
    os.environ["PYTHONHASHSEED"] = _seed
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

EXPECT = {
    "kind": None, "rank": None, "fix": ["sorted", "order"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

METRICS = {"loss", "top1", "recall", "confusion"}
NUM_CLASSES = 4


def evaluate(model, loader) -> dict[str, torch.Tensor]:
    sums = {
        "loss": torch.zeros(1), "top1": torch.zeros(1),
        "recall": torch.zeros(NUM_CLASSES), "confusion": torch.zeros(NUM_CLASSES, NUM_CLASSES),
    }
    with torch.no_grad():
        for x, y in loader:
            logits = model.module(x)
            pred = logits.argmax(1)
            sums["loss"] += nn.functional.cross_entropy(logits, y, reduction="sum")
            sums["top1"] += (pred == y).sum()
            for t, p in zip(y.tolist(), pred.tolist()):
                sums["confusion"][t, p] += 1
            sums["recall"] += torch.bincount(y[pred == y], minlength=NUM_CLASSES)
    for name in METRICS:  # zoo: place
        dist.all_reduce(sums[name])  # zoo: place
    return sums


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    train = TensorDataset(torch.randn(128, 16), torch.randint(0, NUM_CLASSES, (128,)))
    val = TensorDataset(torch.randn(64, 16), torch.randint(0, NUM_CLASSES, (64,)))
    train_loader = DataLoader(train, batch_size=8, sampler=DistributedSampler(train, seed=0))
    val_loader = DataLoader(val, batch_size=16, sampler=DistributedSampler(val, shuffle=False))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, NUM_CLASSES)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in train_loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    metrics = evaluate(model, val_loader)
    if rank == 0:
        loss, top1 = metrics["loss"].item() / len(val), metrics["top1"].item() / len(val)
        print(f"val loss {loss:.4f} top1 {top1:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
