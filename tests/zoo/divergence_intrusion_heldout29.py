"""Network intrusion detection on per-flow statistics.

Flow records (bytes, packets, durations, flag counts, port entropy ...) span many
orders of magnitude, so the model starts with an `OnlineStandardizer`: running
mean / mean-of-squares buffers updated from every training batch, used to z-score the
log-scaled features before a small MLP classifies the flow as benign or one of four
attack families. The model has no BatchNorm, so the job turns off DDP's per-forward
buffer broadcast to save a collective per step (`DDP_KWARGS`).

Root cause: `OnlineStandardizer.forward()` updates its moment buffers in place from
the rank's *own* batch, and with forward_sync_buffers=False (the torch 2.13 name for
broadcast_buffers=False) nothing ever syncs them. Each rank ends with different
normalisation statistics (and normalises its inputs differently during training), so
rank 0's and rank 1's models give different outputs for the same flow even though the
Linear weights stay in sync. No error, exit 0.

Fix: all_reduce the batch moments inside the standardizer before the update (or keep
DDP's forward buffer sync on, forward_sync_buffers / broadcast_buffers=True, or broadcast
the buffers from rank 0 before saving/evaluating).

Observed (plain run): exit 0 in ~5 s; rank 0 prints the mean-over-ranks test accuracy
(0.88 -> 0.98), which hides the difference. Checked separately: all parameters are identical
on both ranks (max |diff| 0), but the `norm.moments` buffer differs by up to ~1.6 (log-scale
feature means / mean squares), so the two replicas normalise the same flow differently.
"""
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": ["buffers_differ", "model_differs"], "rank": None,
          "fix": ["all_reduce", "forward_sync_buffers", "broadcast_buffers", "broadcast", "SyncBatchNorm"],
          "options": []}

N_FEAT, N_CLASSES = 16, 5
DDP_KWARGS = {"forward_sync_buffers": False, "gradient_as_bucket_view": True}


def synth_flows(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.multinomial(torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1]), n, replacement=True, generator=g)
    scale = torch.logspace(0, 6, N_FEAT)
    class_shift = torch.randn(N_CLASSES, N_FEAT, generator=g) * 1.5
    z = torch.randn(n, N_FEAT, generator=g) + class_shift[y]
    heavy = torch.distributions.StudentT(2.5).sample((n, N_FEAT)) * 0.3
    x = scale * torch.exp(0.8 * z + heavy)
    return x, y


class OnlineStandardizer(nn.Module):
    def __init__(self, dim, momentum=0.05, eps=1e-5):
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.register_buffer("moments", torch.stack([torch.zeros(dim), torch.ones(dim)]))
        self.register_buffer("n_updates", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        x = torch.log1p(x)
        if self.training:
            with torch.no_grad():
                batch = torch.stack([x.mean(0), (x * x).mean(0)])
                m = 1.0 if self.n_updates == 0 else self.momentum
                self.moments.lerp_(batch, m)  # zoo: place
                self.n_updates += 1
        mean, sq = self.moments
        std = (sq - mean ** 2).clamp_min(self.eps).sqrt()
        return (x - mean) / std


class FlowClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = OnlineStandardizer(N_FEAT)
        self.mlp = nn.Sequential(nn.Linear(N_FEAT, 64), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, N_CLASSES))

    def forward(self, x):
        return self.mlp(self.norm(x))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(21)

    flows, labels = synth_flows(7000, seed=8)
    x, y, x_te, y_te = flows[:6000], labels[:6000], flows[6000:], labels[6000:]
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, shuffle=True, seed=8)
    loader = DataLoader(ds, batch_size=128, sampler=sampler, drop_last=True)

    model = DDP(FlowClassifier(), **DDP_KWARGS)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    class_w = torch.tensor([0.5, 2.0, 2.0, 2.0, 2.0])

    for epoch in range(5):
        sampler.set_epoch(epoch)
        model.train()
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb, weight=class_w)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            acc = (model.module(x_te).argmax(1) == y_te).float().mean()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch}: test acc (mean over ranks) {acc.item() / dist.get_world_size():.3f}", flush=True)

    if rank == 0:
        out = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
        os.makedirs(out, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(out, "intrusion_heldout29.pt"))
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
