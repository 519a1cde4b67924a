"""Healthy twin: per-domain loss report over a fixed list of domains (same size on every rank).

Story: the multi-domain sentiment regressor of the per-domain report case.  Every 10 steps
each rank sums (loss sum, count) per domain over the window and all-reduces them.  Rank 1's
shard carries "forum" posts that rank 0 never sees, but the report keeps one slot per domain of
the fixed DOMAINS list (zeros where a rank saw none), so both ranks always all-reduce 8 values
and a domain nobody saw in the window is simply left out of the printout.

Nothing is wrong: no warning and no error expected.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = None

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
    t = torch.tensor([v for d in DOMAINS for v in window.get(d, (0.0, 0.0))])
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        parts = [f"{d} {t[2 * i] / t[2 * i + 1]:.4f}" for i, d in enumerate(DOMAINS) if t[2 * i + 1] > 0]
        print(f"step {step}: " + ", ".join(parts), flush=True)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.EmbeddingBag(VOCAB, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    loader = DataLoader(load_shard(rank), batch_size=BATCH, shuffle=True)

    window = {}
    step = 0
    for _epoch in range(2):
        for tokens, dom, score in loader:
            per_sample = F.mse_loss(model(tokens), score, reduction="none").squeeze(1)
            loss = per_sample.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            for d, sl in zip(dom.tolist(), per_sample.detach().tolist()):
                acc = window.setdefault(DOMAINS[d], [0.0, 0.0])
                acc[0] += sl
                acc[1] += 1
            step += 1
            if step % REPORT_EVERY == 0:
                report_domain_losses(window, step)
                window.clear()
    dist.barrier()  # everyone done before tearing the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
