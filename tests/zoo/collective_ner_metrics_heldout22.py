"""Named-entity tagging for shipping manifests.

A BiGRU tagger labels tokens of synthetic shipping-manifest lines (PORT, VESSEL, CARGO, O).
Each rank tokenises its own shard against a fixed vocabulary; tokens missing from the
vocabulary map to <unk>. Every 15 steps the ranks average their running metrics with
all_reduce so rank 0 can print global numbers. A later change added an "oov_rate" metric
that is only recorded when the shard actually contained unknown tokens -- and only rank 1's
shard (newer manifests with new vessel names) ever does.

Root cause: MetricTracker.snapshot() only adds the "oov_rate" entry when this rank saw
unknown tokens, so rank 1 issues one more all_reduce than rank 0 in sync_metrics(); rank 1's
extra scalar all_reduce meets rank 0's next gradient all-reduce (different size) and gloo aborts.
Fix: give every rank the same metric keys in the same order (always record oov_rate, 0 when
none), or reduce a single fixed-size tensor of all metrics.
"""

import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": ["collective_mismatch", "rank_failure"],
    "rank": 1,
    "fix": [
        "same keys",
        "same order",
        "every rank",
        "all ranks",
        "always",
        "oov",
        "metric",
        "fixed",
        "single tensor",
        "same number",
        "consistent",
        "collective",
        "match",
        "shape",
        "size",
    ],
    "options": [],
}

TAGS = ["O", "PORT", "VESSEL", "CARGO"]
PORTS = ["rotterdam", "hamburg", "antwerp", "singapore", "busan", "santos", "durban"]
VESSELS_OLD = ["maersk_elba", "msc_oscar", "cosco_star", "ever_given", "hmm_algeciras"]
VESSELS_NEW = ["one_innovation", "msc_irina", "ever_alot"]  # launched after the vocab freeze
CARGO = ["copper", "soybeans", "timber", "containers", "crude", "coffee"]
FILLER = ["loaded", "at", "bound", "for", "via", "aboard", "tons", "of", "the", "departing"]


def build_vocab():
    words = ["<pad>", "<unk>"] + PORTS + VESSELS_OLD + CARGO + FILLER
    return {w: i for i, w in enumerate(words)}


def synth_manifests(n, rank, seed):
    rng = random.Random(seed)
    vessels = VESSELS_OLD + (VESSELS_NEW if rank == 1 else [])
    lines = []
    for _ in range(n):
        toks = [
            (rng.choice(["loaded", "departing"]), "O"),
            (rng.choice(CARGO), "CARGO"),
            ("aboard", "O"),
            (rng.choice(vessels), "VESSEL"),
            (rng.choice(["at", "via"]), "O"),
            (rng.choice(PORTS), "PORT"),
            ("bound", "O"),
            ("for", "O"),
            (rng.choice(PORTS), "PORT"),
        ]
        lines.append(toks)
    return lines


def encode(lines, vocab):
    ids = torch.tensor([[vocab.get(w, vocab["<unk>"]) for w, _ in line] for line in lines])
    tags = torch.tensor([[TAGS.index(t) for _, t in line] for line in lines])
    return ids, tags


class Tagger(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 24)
        self.rnn = nn.GRU(24, 32, batch_first=True, bidirectional=True)
        self.out = nn.Linear(64, len(TAGS))

    def forward(self, ids):
        h, _ = self.rnn(self.emb(ids))
        return self.out(h)


class MetricTracker:
    def __init__(self, unk_id):
        self.unk_id = unk_id
        self.reset()

    def reset(self):
        self.loss_sum, self.correct, self.total, self.unk = 0.0, 0, 0, 0

    def update(self, loss, logits, ids, tags):
        self.loss_sum += loss.item() * ids.numel()
        self.correct += (logits.argmax(-1) == tags).sum().item()
        self.total += ids.numel()
        self.unk += (ids == self.unk_id).sum().item()

    def snapshot(self):
        m = {
            "loss": torch.tensor(self.loss_sum / max(self.total, 1)),
            "acc": torch.tensor(self.correct / max(self.total, 1)),
        }
        if self.unk > 0:
            m["oov_rate"] = torch.tensor(self.unk / self.total)  # zoo: place
        return m


def sync_metrics(metrics, world):
    for name, value in metrics.items():
        dist.all_reduce(value)
        metrics[name] = value / world
    return metrics


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = build_vocab()
    ids, tags = encode(synth_manifests(1200, rank, seed=7 + rank), vocab)
    torch.manual_seed(0)
    model = DDP(Tagger(len(vocab)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    tracker = MetricTracker(vocab["<unk>"])
    bs = 32
    for step in range(90):
        i = (step * bs) % len(ids)
        x, y = ids[i : i + bs], tags[i : i + bs]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, len(TAGS)), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        tracker.update(loss, logits.detach(), x, y)
        if (step + 1) % 15 == 0:
            m = sync_metrics(tracker.snapshot(), world)
            tracker.reset()
            if rank == 0:
                print(f"step {step + 1} " + " ".join(f"{k}={v.item():.3f}" for k, v in m.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
