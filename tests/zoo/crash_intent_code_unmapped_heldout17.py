"""Rank 1 hits an intent code its label map does not know, mid-step -> rank 1 raises KeyError.

Story: an intent classifier is trained on support-chat logs.  Each node reads the shard of its
own site (the shards are exported per site, already shuffled).  Raw intent codes are turned into
class indices by `encode_labels` through the label map from the project config.  Site B (rank 1)
started logging a new intent code (9041) that nobody added to the config; its first record is
in rank 1's 7th batch.  Rank 1 runs the DDP forward of that step and then dies with a KeyError
while building the targets; rank 0 goes on into backward and its gradient all-reduce loses its
peer ("Connection closed by peer" / reset) -- a consequence, not the cause.

Root cause: rank 1's own exception (KeyError in encode_labels).
Fix: map unknown codes (to an "other" class, or drop them when the shard is written / in the
dataset), keep the label map in sync with the data.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": "rank_failure",
    "rank": 1,
    "fix": ["keyerror", "exception", "traceback", "label", "9041", "encode_labels", "unknown"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

# from the project config: raw intent code -> class index
LABEL_MAP = {1010: 0, 1020: 1, 2210: 2, 3005: 3, 4100: 4, 5200: 5}
VOCAB = 500
SEQ = 20
BATCH = 16


def load_site_shard(rank, n=256):
    """Stand-in for reading this site's exported shard (token ids, raw intent codes)."""
    g = torch.Generator().manual_seed(1234 + rank)
    codes = list(LABEL_MAP)
    cls = torch.randint(0, len(codes), (n,), generator=g)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    tokens[:, :4] = cls[:, None] * 60 + torch.randint(0, 60, (n, 4), generator=g)
    raw = torch.tensor([codes[c] for c in cls.tolist()])
    if rank == 1:
        raw[6 * BATCH + 9] = 9041  # site B logs a brand-new intent from here on
    return TensorDataset(tokens, raw)


def encode_labels(raw_codes):
    return torch.tensor([LABEL_MAP[c] for c in raw_codes.tolist()])  # zoo: place


class IntentNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, 48)
        self.head = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, len(LABEL_MAP)))

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(IntentNet())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = DataLoader(load_site_shard(rank), batch_size=BATCH, shuffle=False)

    for epoch in range(3):
        total, n = 0.0, 0
        for _step, (tokens, raw) in enumerate(loader):
            logits = model(tokens)
            targets = encode_labels(raw)
            loss = F.cross_entropy(logits, targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            n += 1
        if rank == 0:
            print(f"epoch {epoch}: train loss {total / n:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
