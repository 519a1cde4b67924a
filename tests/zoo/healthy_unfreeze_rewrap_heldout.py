"""Healthy twin of divergence_unfreeze_after_wrap: the model is re-wrapped after unfreezing.

Story: the surface-defect classifier fine-tuned from a "pretrained" encoder.  Stage 1 (epochs
0-1) trains the head with the backbone frozen before DDP construction; at epoch 2
`unfreeze_backbone` sets requires_grad on the backbone, adds its optimizer param group, and
builds a NEW `DDP(model.module)` so the reducer now buckets the backbone's parameters too (the
constructor also re-broadcasts rank 0's weights, which are identical anyway).  From then on
every parameter's gradient is all-reduced and the replicas stay identical.  The job exits 0.

Right diagnosis: nothing wrong (weights identical on all ranks; re-wrapping is a normal
pattern).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = None


def spectra(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    peaks = torch.randn(4, 24, generator=g)
    x = peaks[y] + 0.9 * torch.randn(n, 24, generator=g)
    return TensorDataset(x, y)


class DefectNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(24, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


def load_pretrained(net):
    torch.manual_seed(1234)  # stands in for torch.load("encoder-pretrained.pt")
    for m in net.backbone:
        if isinstance(m, nn.Linear):
            nn.init.orthogonal_(m.weight)
            nn.init.zeros_(m.bias)


def unfreeze_backbone(model, opt, lr):
    backbone = model.module.backbone
    for p in backbone.parameters():
        p.requires_grad_(True)
    opt.add_param_group({"params": list(backbone.parameters()), "lr": lr})
    return DDP(model.module)  # DDP only syncs what required grad when it was built: re-wrap


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = DefectNet()
    load_pretrained(net)
    net.backbone.requires_grad_(False)  # stage 1: linear probe
    model = DDP(net)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    ds = spectra(2048)
    sampler = DistributedSampler(ds, world, rank, shuffle=True)
    loader = DataLoader(ds, batch_size=32, sampler=sampler)
    for epoch in range(5):
        if epoch == 2:
            model = unfreeze_backbone(model, opt, lr=5e-4)
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        torch.save(model.module.state_dict(),
                   os.path.join(tempfile.gettempdir(), f"defect-{os.environ['MASTER_PORT']}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
