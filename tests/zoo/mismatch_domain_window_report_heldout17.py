"""Per-domain loss report whose tensor length follows each rank's own data -> all_reduce mismatch.

Story: a sentiment regressor trained on text from several domains.  Every 10 steps
`report_domain_losses` sums each rank's (loss sum, count) per domain seen in the window and
all-reduces them to print global per-domain losses.  The tensor holds one pair per domain the
*rank* saw.  Both ranks see news/reviews/tweets in every window (6 values), until rank 1's
shard (crawled later) starts carrying "forum" posts in the third window: rank 1 all-reduces 8
values while rank 0 all-reduces 6.  gloo does not notice: rank 0's call returns (it even
prints a report), rank 1's keeps waiting for the rest of its 8 values, and rank 0 then blocks
in the next step's gradient all-reduce.  Both wait forever.

Root cause: the all_reduce whose element count depends on each rank's data; rank 1's count
changed (6 -> 8) at that report.
Fix: reduce a fixed-size tensor (one slot per domain in a fixed domain list, zeros for unseen
ones), or agree on the keys/size first.
"""

from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": "collective_mismatch",
    "rank": 1,
    "fix": ["size", "shape", "fixed", "same length", "pad", "every rank", "all ranks", "same number"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

DOMAINS = ["news", "reviews", "tweets", "forum"]
VOCAB = 400
BATCH = 16
REPORT_EVERY = 10


def load_shard(rank, n=640):
    """Stand-in for this node's slice of the crawl: token ids, domain ids, sentiment scores."""
    g = torch.Generator().manual_seed(77 + rank)
    dom = torch.randint(0, 3, (n,), generator=g)
    if rank == 1:
        # the later part of rank 1's slice comes from the forum crawl
        late = torch.arange(n) >= 2 * REPORT_EVERY * BATCH + 3
        dom[late & (torch.rand(n, generator=g) < 0.15)] = 3
    tokens = torch.randint(0, VOCAB, (n, 24), generator=g)
    score = (tokens[:, :6] < VOCAB // 2).float().mean(1, keepdim=True) * 2 - 1
    return TensorDataset(tokens, dom, score + 0.1 * torch.randn(n, 1, generator=g))


def report_domain_losses(window, step):
    names = sorted(window)
    t = torch.tensor([v for d in names for v in window[d]])
    dist.all_reduce(t)  # zoo: place
    if dist.get_rank() == 0:
        parts = [f"{d} {t[2 * i] / t[2 * i + 1]:.4f}" for i, d in enumerate(names)]
        print(f"step {step}: " + ", ".join(parts), flush=True)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.EmbeddingBag(VOCAB, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    loader = DataLoader(load_shard(rank), batch_size=BATCH, shuffle=False)

    window = defaultdict(lambda: [0.0, 0.0])
    step = 0
    for _epoch in range(2):
        for tokens, dom, score in loader:
            per_sample = F.mse_loss(model(tokens), score, reduction="none").squeeze(1)
            loss = per_sample.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            for d, sl in zip(dom.tolist(), per_sample.detach().tolist()):
                window[DOMAINS[d]][0] += sl
                window[DOMAINS[d]][1] += 1
            step += 1
            if step % REPORT_EVERY == 0:
                report_domain_losses(window, step)
                window.clear()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
