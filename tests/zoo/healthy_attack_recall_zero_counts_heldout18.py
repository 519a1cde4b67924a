"""Healthy twin: a per-epoch recall sync where a rank with nothing to report sends zeros.

Story: an intrusion detector for network flows validates, after every epoch, on that
epoch's slice of each rank's own capture.  Some slices contain no attacks at all (rank 0's
slice for epoch 2 is a quiet night).  The metrics helper never divides locally: it packs the
raw counts (tp, fp, fn) into a tensor -- zeros when the rank saw no attack -- and every rank
all-reduces it every epoch; the global precision/recall is computed from the sums.  Both
ranks always make the same collectives, so nothing hangs and nothing diverges.

Expected: no warning, no error.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None


def flows(seed, n, attack_rate):
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) < attack_rate).float()
    x = torch.randn(n, 20, generator=g)
    x[:, :5] += 1.8 * y[:, None]
    return x, y


def sync_detection_counts(logits, labels):
    """Global (precision, recall); a rank with no attacks in its slice contributes zeros."""
    pred = logits > 0
    pos = labels > 0
    counts = torch.tensor([
        float((pred & pos).sum()),
        float((pred & ~pos).sum()),
        float((~pred & pos).sum()),
    ])
    dist.all_reduce(counts)
    tp, fp, fn = counts.tolist()
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else float("nan")
    return precision, recall


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    x, y = flows(1, 2048, attack_rate=0.2)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    # one validation slice per epoch and rank; rank 0's epoch-2 slice has no attacks
    slices = [flows(50 + 10 * rank + e, 96, 0.0 if (rank, e) == (0, 2) else 0.2) for e in range(5)]

    for epoch in range(5):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.binary_cross_entropy_with_logits(model(xb).squeeze(-1), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        vx, vy = slices[epoch]
        with torch.no_grad():
            logits = model.module(vx).squeeze(-1)
        precision, recall = sync_detection_counts(logits, vy)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} precision {precision:.3f} "
                  f"recall {recall:.3f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
