"""Tumour / benign patch classifier for two pathology sites with a BatchNorm CNN (2-rank DDP, gloo/CPU).

What the job does
-----------------
Two hospitals contribute H&E-like 24x24 RGB patches (synthetic, seeded): tumour patches
have denser nuclei.  Data never leaves a site, so rank 0 trains on site A's patches and
rank 1 on site B's; site B's scanner is brighter and has a colour cast.  A Conv-BN-ReLU
network is wrapped in DDP and trained with SGD+momentum for a few epochs; afterwards every
rank evaluates its replica (model.module, eval mode) on the same mixed test set.

Root cause
----------
The DDP wrapper was copied from a GAN training script and passes
`broadcast_buffers=False`.  Gradients are still averaged, so the convolution / affine
weights stay identical, but BatchNorm running_mean / running_var are never synchronised:
each rank's running statistics track its own site's stain intensities.  After training
the replicas' buffers differ, and eval-mode predictions depend on which rank's copy is
saved or used (the two replicas score the same test set differently).

Fix
---
Keep the default `broadcast_buffers=True` (rank 0's stats are broadcast each forward), or
better here, convert the BN layers with `nn.SyncBatchNorm.convert_sync_batchnorm` so the
statistics are computed over both sites.

Observed (plain run, torchrun --nproc_per_node 2, OMP_NUM_THREADS=1)
--------------------------------------------------------------------
exit 0 after ~6-8 s (4 epochs x 48 steps).  torch 2.13 also prints a FutureWarning that
`broadcast_buffers` is deprecated.  Last lines:
    [rank 0] this replica's test acc: site A 0.977, site B 0.496, mixed 0.736
    [rank 1] this replica's test acc: site A 0.492, site B 0.980, mixed 0.736
    replica 0: params sum 33.55276243 ... | bn buffers sum 26.378243 sq 109.508879
    replica 1: params sum 33.55276243 ... | bn buffers sum 21.384039 sq 110.612787
    params identical across ranks: True; bn running stats identical: False
"""
import gc
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": ["buffers_differ", "weights_diverged"], "rank": None, "fix": ["broadcast_buffers", "syncbatchnorm", "convert_sync_batchnorm", "buffers"], "options": []}

PATCH = 24
STAIN = {
    "A": {"gain": torch.tensor([0.85, 0.75, 0.95]), "offset": torch.tensor([0.00, 0.00, 0.02])},
    "B": {"gain": torch.tensor([1.30, 1.15, 1.05]), "offset": torch.tensor([0.12, 0.10, 0.18])},
}


def site_patches(n, site, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    density = torch.where(y == 1, torch.tensor(0.07), torch.tensor(0.03))
    seeds = (torch.rand(n, 1, PATCH, PATCH, generator=g) < density[:, None, None, None]).float()
    nuclei = F.max_pool2d(seeds, 3, stride=1, padding=1)
    stroma = 0.75 + 0.08 * torch.randn(n, 3, PATCH, PATCH, generator=g)
    hema = torch.tensor([0.45, 0.55, 0.15])[None, :, None, None]
    img = stroma - nuclei * hema
    st = STAIN[site]
    img = img * st["gain"][None, :, None, None] + st["offset"][None, :, None, None]
    return img.clamp(0, 1.5), y


def build_net():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 2),
    )


def checksum(tensors):
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    return torch.stack([flat.sum(), (flat * flat).sum()])


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    site = "AB"[rank]
    x, y = site_patches(1536, site, seed=400 + rank)
    print(f"[rank {rank}] site {site}: {len(x)} patches, mean intensity {x.mean():.3f}", flush=True)

    torch.manual_seed(0)
    net = build_net()
    model = DDP(net, broadcast_buffers=False)  # zoo: place
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    bs, epochs = 32, 4
    g = torch.Generator().manual_seed(rank)
    t_start = time.time()
    for epoch in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        correct = 0
        for i in range(0, len(x) - bs + 1, bs):
            idx = perm[i:i + bs]
            out = model(x[idx])
            loss = F.cross_entropy(out, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct += (out.argmax(1) == y[idx]).sum().item()
        print(f"[rank {rank}] epoch {epoch} last loss {loss.item():.4f} train acc {correct / len(x):.3f} "
              f"({time.time() - t_start:.1f}s)", flush=True)

    # both replicas score the same mixed-site test set
    xa, ya = site_patches(256, "A", seed=999)
    xb, yb = site_patches(256, "B", seed=998)
    net.eval()
    with torch.no_grad():
        acc_a = (net(xa).argmax(1) == ya).float().mean().item()
        acc_b = (net(xb).argmax(1) == yb).float().mean().item()
    print(f"[rank {rank}] this replica's test acc: site A {acc_a:.3f}, site B {acc_b:.3f}, "
          f"mixed {(acc_a + acc_b) / 2:.3f}", flush=True)

    buffers = [b for n, b in net.named_buffers() if "running" in n]
    mine = torch.cat([checksum(net.parameters()), checksum(buffers)])
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        for r, v in enumerate(every):
            print(f"replica {r}: params sum {v[0]:.8f} sq {v[1]:.8f} | bn buffers sum {v[2]:.6f} sq {v[3]:.6f}",
                  flush=True)
        print(f"params identical across ranks: {torch.equal(every[0][:2], every[1][:2])}; "
              f"bn running stats identical: {torch.equal(every[0][2:], every[1][2:])}", flush=True)
    del model, net
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
