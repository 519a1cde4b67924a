"""Two-stage fine-tuning: train the head on a frozen backbone, then unfreeze the backbone and
rebuild the DDP wrapper once the head has converged. Each rank reads its own site's data and
judges "converged" from its own running loss, so only rank 1 (clean site) rebuilds DDP; the
new wrapper's constructor collectives meet rank 0's gradient all-reduce and the job hangs."""
import collections

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": ["rank_only_collective", "collective_mismatch", "hang"],
    "rank": 1,
    "fix": ["every rank", "all ranks", "all_reduce", "broadcast", "agree"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

NUM_CLASSES = 4
SITE_LABEL_NOISE = {0: 0.45, 1: 0.02}   # site 0's annotations are known to be noisy
HEAD_CONVERGED_LOSS = 0.35


def load_site(site, n=1536, dim=32):
    """Site-specific shard: same underlying classes, different annotation quality."""
    g_task = torch.Generator().manual_seed(1234)
    centres = torch.randn(NUM_CLASSES, dim, generator=g_task) * 1.5
    g = torch.Generator().manual_seed(100 + site)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    x = centres[y] + torch.randn(n, dim, generator=g)
    flip = torch.rand(n, generator=g) < SITE_LABEL_NOISE[site]
    y = torch.where(flip, torch.randint(0, NUM_CLASSES, (n,), generator=g), y)
    return TensorDataset(x, y)


class SiteClassifier(nn.Module):
    def __init__(self, dim=32, width=128):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, width), nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, x):
        return self.head(self.backbone(x))


def unfreeze_and_rewrap(ddp_model, lr):
    module = ddp_model.module
    for p in module.backbone.parameters():
        p.requires_grad_(True)
    # DDP only registers hooks for params that require grad at construction: rebuild it.
    new_model = DDP(module)  # zoo: place
    opt = torch.optim.AdamW(new_model.parameters(), lr=lr, weight_decay=0.01)
    return new_model, opt


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    loader = DataLoader(load_site(rank), batch_size=32, shuffle=True, drop_last=True)
    net = SiteClassifier()
    for p in net.backbone.parameters():
        p.requires_grad_(False)
    model = DDP(net)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    recent = collections.deque(maxlen=16)
    unfrozen = False
    step = 0
    for epoch in range(4):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            recent.append(loss.item())
            head_converged = len(recent) == recent.maxlen and sum(recent) / len(recent) < HEAD_CONVERGED_LOSS
            if not unfrozen and head_converged:
                print(f"rank {rank}: head converged at step {step}, unfreezing backbone", flush=True)
                model, opt = unfreeze_and_rewrap(model, lr=1e-3)
                unfrozen = True
            if step % 20 == 0:
                print(f"rank {rank} epoch {epoch} step {step} loss {loss.item():.3f}", flush=True)
            step += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
