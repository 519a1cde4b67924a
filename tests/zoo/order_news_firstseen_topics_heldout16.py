"""News classifier (bag of words) whose per-topic statistics are synced in the order each rank
first met the topics in its own batches.

The job: short news items, as bag-of-words count vectors, are classified into 14 fine labels
that belong to 4 coarse topics (sports has 4 fine labels, politics 3, tech 5, science 2). The
first two epochs train on the two big topics only (sports, politics); from epoch 2 on the rare
topics (tech, science) join. For the epoch summary a `TopicBreakdown` keeps, per coarse topic,
the hits and the counts of each of its fine labels, so the topic buffers have different sizes
(8, 6, 10 and 4 numbers). The buffers live in a dict that is filled lazily, for the whole run:
a topic's buffer is created the first time an item of that topic turns up in the rank's
batches (and zeroed at each epoch start). At the end of every epoch the breakdown walks the dict
and all-reduces every buffer.

The bug: a dict iterates in insertion order, and the insertion order is the order in which the
topics first appeared in this rank's own shard of the shuffled data. In the first two epochs
both ranks hold {sports, politics} in the same order and the syncs match; in epoch 2 rank 0
meets a science item before its first tech item and rank 1 the other way round, so at the
third position of the epoch-end sync rank 0 all-reduces the 4-number science buffer and rank 1
the 10-number tech buffer: the sizes differ and the job fails there.

Fix: create the buffers for all topics up front, or walk a fixed list of topics (sorted names)
when syncing.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

EXPECT = {"kind": None, "rank": None, "fix": [], "options": ["--hang-timeout", "8", "--on-hang", "kill"]}

N_SUB = {"sports": 4, "politics": 3, "tech": 5, "science": 2}
TOPIC_SHARE = {"sports": 0.5, "politics": 0.3, "tech": 0.14, "science": 0.06}
TOPICS = list(N_SUB)
VOCAB = 400
EPOCHS = 8
WARMUP_EPOCHS = 2  # epochs on the two big topics only
DATA_SEED = 1


def label_table():
    """fine label -> (coarse topic index, index inside the topic)"""
    table = []
    for t, name in enumerate(TOPICS):
        table += [(t, i) for i in range(N_SUB[name])]
    return table


def make_news(n=1536, doc_len=30, seed=DATA_SEED):
    g = torch.Generator().manual_seed(seed)
    table = label_table()
    word_probs = torch.rand(len(table), VOCAB, generator=g) ** 6
    word_probs /= word_probs.sum(1, keepdim=True)
    topic = torch.multinomial(torch.tensor(list(TOPIC_SHARE.values())), n, replacement=True,
                              generator=g)
    offsets = torch.tensor([sum(list(N_SUB.values())[:t]) for t in range(len(TOPICS))])
    sizes = torch.tensor(list(N_SUB.values()))
    fine = offsets[topic] + (torch.rand(n, generator=g) * sizes[topic]).long()
    words = torch.multinomial(word_probs[fine], doc_len, replacement=True, generator=g)
    bow = torch.zeros(n, VOCAB).scatter_add_(1, words, torch.ones(n, doc_len))
    return TensorDataset(bow, fine, topic)


class TopicBreakdown:
    def __init__(self):
        self.table = label_table()
        self.buffers = {}

    def update(self, pred, fine, topic):
        for p, f, t in zip(pred.tolist(), fine.tolist(), topic.tolist()):
            name = TOPICS[t]
            buf = self.buffers.setdefault(name, torch.zeros(2 * N_SUB[name]))  # zoo: place
            sub = self.table[f][1]
            buf[N_SUB[name] + sub] += 1
            buf[sub] += float(p == f)

    def reset(self):
        for buf in self.buffers.values():
            buf.zero_()

    def sync(self):
        for name, buf in self.buffers.items():  # noqa: B007 (the order is the point)
            dist.all_reduce(buf)

    def summary(self):
        parts = []
        for name, buf in self.buffers.items():
            k = N_SUB[name]
            parts.append(f"{name} {buf[:k].sum() / buf[k:].sum().clamp(min=1):.3f}")
        return " ".join(parts)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = make_news()
    common = Subset(data, (data.tensors[2] < 2).nonzero().squeeze(1).tolist())
    stages = []
    for part in (common, data):  # the big topics first, then everything
        sampler = DistributedSampler(part, shuffle=True, seed=0)
        stages.append((sampler, DataLoader(part, batch_size=32, sampler=sampler)))
    n_fine = sum(N_SUB.values())
    model = DDP(nn.Sequential(nn.Linear(VOCAB, 64), nn.ReLU(), nn.Linear(64, n_fine)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    breakdown = TopicBreakdown()
    for epoch in range(EPOCHS):
        sampler, loader = stages[0] if epoch < WARMUP_EPOCHS else stages[1]
        sampler.set_epoch(epoch)
        breakdown.reset()
        for bow, fine, topic in loader:
            logits = model(bow)
            loss = F.cross_entropy(logits, fine)
            opt.zero_grad()
            loss.backward()
            opt.step()
            breakdown.update(logits.argmax(1), fine, topic)
        breakdown.sync()
        if rank == 0:
            print(f"epoch {epoch} train acc by topic: {breakdown.summary()}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
