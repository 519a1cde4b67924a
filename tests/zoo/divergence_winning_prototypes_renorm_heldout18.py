"""A prototype head renormalises, in its forward, only the prototypes its batch picked (divergence).

Story: a few-shot style image-patch classifier scores embeddings against learned class
prototypes (`PrototypeHead.prototypes`, a trainable nn.Parameter).  To keep the prototypes
on the unit sphere "where the cosine logits live" the author renormalises, in forward and
under torch.no_grad(), the rows of the prototypes that won at least one sample of the current
batch -- cheaper than touching all of them.  Which rows win depends on each rank's own
batch, so each rank rewrites a different subset of rows in place.  DDP all-reduces the
gradients, never the weights, so from the first steps on the ranks hold different
`head.prototypes`; no error, the job finishes and rank 0 saves its own copy.

Root cause: a rank-dependent in-place update in forward (no single root rank).
Right diagnosis: weights diverged in `head.prototypes`, changed in place by the forward
from each rank's own batch.
Fix: renormalise every row (independent of the batch), or normalise inside the computation
(F.normalize on the fly) instead of rewriting the parameter, so every rank applies the same
update.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["weights_diverged"],
    "rank": None,
    "fix": ["every rank", "all ranks", "identical", "normalize", "normalise", "all_reduce",
            "broadcast"],
    "names": ["prototypes"],
    "options": [],
}


class PrototypeHead(nn.Module):
    def __init__(self, dim, classes):
        super().__init__()
        self.prototypes = nn.Parameter(F.normalize(torch.randn(classes, dim), dim=1))
        self.scale = 8.0

    def forward(self, z):
        z = F.normalize(z, dim=1)
        with torch.no_grad():
            winners = (z @ self.prototypes.t()).argmax(1).unique()
            self.prototypes[winners] = F.normalize(self.prototypes[winners], dim=1)  # zoo: place
        return self.scale * z @ self.prototypes.t()


class PatchNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 32))
        self.head = PrototypeHead(32, classes)

    def forward(self, x):
        return self.head(self.encoder(x))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = PatchNet()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    g = torch.Generator().manual_seed(3)
    centers = torch.randn(10, 48, generator=g)
    y = torch.randint(0, 10, (2048,), generator=g)
    x = centers[y] + 0.8 * torch.randn(2048, 48, generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)

    for epoch in range(3):
        sampler.set_epoch(epoch)
        for _step, (xb, yb) in enumerate(loader):
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)

    dist.barrier()
    if rank == 0:
        torch.save(net.state_dict(), "/tmp/patch_prototypes.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
