"""Backbone unfrozen after DDP was built: its gradients are never all-reduced (silent
divergence of the weights across ranks).

Story: fine-tuning a "pretrained" encoder for a surface-defect classifier on 24-dim sensor
spectra.  Stage 1 (epochs 0-1) trains only the head: the backbone is frozen with
`requires_grad_(False)` *before* the model is wrapped in DDP -- so DDP registers only the
head's parameters with its reducer.  Stage 2 (epoch 2 on) "unfreezes" the backbone in place
(`unfreeze_backbone`: `requires_grad_(True)` + a new optimizer param group with a smaller lr)
and keeps using the same DDP object.  From then on the backbone receives gradients computed
from each rank's own batches only; DDP never all-reduces them (they are not in its buckets),
so every rank's backbone drifts its own way.  Nothing errors, nothing hangs; the job exits 0,
and the checkpoint rank 0 writes is just rank 0's private model.

Root cause: parameters that started requiring grad after DDP construction
(`unfreeze_backbone` on the wrapped model) -- no rank in particular; all ranks diverge.
Right diagnosis: the backbone's weights (backbone.*) differ between ranks after epoch 2; their
gradients are not synchronized because they were frozen when DDP was constructed.
Fix: re-wrap the module in a new DDP after unfreezing (`DDP(model.module)`), or build DDP with
every parameter requiring grad and freeze by other means (e.g. an lr of 0 for the backbone
param group), so DDP's reducer includes the backbone.
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

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": ["re-wrap", "rewrap", "wrap again", "new ddp", "recreate", "re-create", "rebuild",
            "requires_grad", "unfreeze", "before wrapping", "before ddp", "ddp(model.module"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


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
        p.requires_grad_(True)  # zoo: place
    opt.add_param_group({"params": list(backbone.parameters()), "lr": lr})


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
            unfreeze_backbone(model, opt, lr=5e-4)  # zoo: place
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
