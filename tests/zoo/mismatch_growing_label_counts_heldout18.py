"""Class-balanced loss weights from a label-count list that grows on one rank -> mismatch.

Story: a product-category classifier trains on a daily stream: each epoch every rank reads
its own region's new day of listings.  For a class-balanced loss the trainer keeps a
`LabelStats` object whose `counts` list grows whenever a label id beyond its end shows up
("the catalogue adds categories over time"), and at the start of every epoch it all-reduces
the counts so every rank uses the same global weights.  For the first two days both regions
saw categories 0..5, so the tensor had 6 entries on both ranks.  On day 2 rank 0's region
lists the first items of the new category 6: rank 0's counts grow to 7 entries while rank 1
still has 6, and the all_reduce from the same line now gets 7 elements on rank 0 and 6 on
rank 1.

Root cause: rank 0 (its element count changed from its own earlier calls of that line).
Fix: all-reduce a fixed-size tensor (size it by the catalogue's number of classes, known up
front, or agree on the max label first with an all_reduce(MAX) and pad).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)

EXPECT = {
    "kind": ["collective_mismatch"],
    "rank": 0,
    "fix": ["fixed", "num_classes", "number of classes", "same size", "same length", "pad",
            "size", "length", "shape"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

MAX_CATEGORIES = 16  # size of the output layer; the counts only track what was seen


def day_of_listings(rank, day, n=256):
    g = torch.Generator().manual_seed(31 * rank + day)
    y = torch.randint(0, 6, (n,), generator=g)
    if rank == 0 and day >= 2:  # region 0 launched the "garden" category on day 2
        y[:: 9] = 6
    x = torch.randn(n, 24, generator=g)
    x[torch.arange(n), y] += 2.5
    return x, y


class LabelStats:
    def __init__(self):
        self.counts = []

    def observe(self, labels):
        for label in labels.tolist():
            while label >= len(self.counts):
                self.counts.append(0)
            self.counts[label] += 1

    def global_weights(self):
        totals = torch.tensor(self.counts, dtype=torch.float64)
        dist.all_reduce(totals)  # zoo: place
        weights = totals.sum() / (len(totals) * totals.clamp(min=1))
        full = torch.ones(MAX_CATEGORIES)
        full[: len(weights)] = weights.float()
        return full


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, MAX_CATEGORIES)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stats = LabelStats()

    for day in range(5):
        x, y = day_of_listings(rank, day)
        stats.observe(y)
        class_weights = stats.global_weights()
        for i in range(0, len(x), 32):
            loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32], weight=class_weights)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"day {day} loss {loss.item():.4f} weights {class_weights[:7].tolist()}",
                  flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
