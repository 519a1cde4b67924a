"""Metric tracker syncs its metrics in a rank-dependent order -> hang at epoch end.

Story: a multi-task NLU model (shared encoder, an intent head and a slot head) is trained
with a round-robin task schedule that is offset by rank ("so ranks work on different tasks
at the same time"); DDP uses find_unused_parameters=True, which is correct here.  A
`MetricTracker` lazily creates a metric object the first time a task is seen and, at the
end of the epoch, syncs them with `for name, m in self.metrics.items(): m.sync()`.
Because the dict is filled in first-seen order, rank 0 holds {intent, slots} and rank 1
holds {slots, intent}.  `IntentAccuracy.sync` all-reduces its counts while
`SlotF1.sync` all-gathers per-rank counts, so at the end of epoch 0 rank 0 is in an
all_reduce and rank 1 in an all_gather: both wait forever.

Root cause: no single rank -- the two ranks issue the same collectives in a different
order.
Right diagnosis: a hang where the ranks are in different collectives (collective order
mismatch) in the metric sync at epoch end.
Fix: iterate the metrics in a fixed, rank-independent order (e.g. sorted(self.metrics)),
or register all metrics up front.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": [
        "sorted",
        "sort",
        "order",
        "deterministic",
        "up front",
        "upfront",
        "register all",
        "same sequence",
    ],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

TASKS = ["intent", "slots"]


class IntentAccuracy:
    def __init__(self):
        self.counts = torch.zeros(2)  # correct, total

    def update(self, logits, target):
        self.counts[0] += (logits.argmax(-1) == target).sum()
        self.counts[1] += target.numel()

    def sync(self):
        dist.all_reduce(self.counts)
        return (self.counts[0] / self.counts[1]).item()


class SlotF1:
    def __init__(self, n_tags=5):
        self.tp_fp_fn = torch.zeros(3)

    def update(self, logits, target):
        pred = logits.argmax(-1)
        self.tp_fp_fn[0] += ((pred == target) & (target > 0)).sum()
        self.tp_fp_fn[1] += ((pred != target) & (pred > 0)).sum()
        self.tp_fp_fn[2] += ((pred != target) & (target > 0)).sum()

    def sync(self):
        parts = [torch.zeros(3) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, self.tp_fp_fn)
        tp, fp, fn = torch.stack(parts).sum(0)
        return (2 * tp / (2 * tp + fp + fn + 1e-9)).item()


class MetricTracker:
    FACTORIES = {"intent": IntentAccuracy, "slots": SlotF1}

    def __init__(self):
        self.metrics = {}

    def update(self, task, logits, target):
        if task not in self.metrics:
            self.metrics[task] = self.FACTORIES[task]()
        self.metrics[task].update(logits, target)

    def compute(self):
        return {name: m.sync() for name, m in self.metrics.items()}


class NLUModel(nn.Module):
    def __init__(self, vocab=300, dim=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.enc = nn.GRU(dim, dim, batch_first=True)
        self.intent_head = nn.Linear(dim, 6)
        self.slot_head = nn.Linear(dim, 5)

    def forward(self, tokens, task):
        h, last = self.enc(self.emb(tokens))
        if task == "intent":
            return self.intent_head(last[-1])
        return self.slot_head(h)


def batch_for(task, g, bs=16, seq=10):
    tokens = torch.randint(0, 300, (bs, seq), generator=g)
    if task == "intent":
        return tokens, tokens[:, 0] % 6
    return tokens, tokens % 5


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(NLUModel(), find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(rank)

    for epoch in range(3):
        tracker = MetricTracker()
        for step in range(20):
            task = TASKS[(step + rank) % len(TASKS)]
            tokens, target = batch_for(task, g)
            logits = model(tokens, task)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            tracker.update(task, logits.detach(), target)
        scores = tracker.compute()
        if rank == 0:
            print(f"epoch {epoch} {scores}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
