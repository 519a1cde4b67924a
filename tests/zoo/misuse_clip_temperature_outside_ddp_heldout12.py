"""CLIP-style dual encoder (image features <-> caption features) with a learnable temperature.
The temperature, logit_scale, is created in the training script and handed to the optimizer
next to model.parameters(), so it is not part of the DDP module: its gradient is never
all-reduced and each rank trains its own copy from its own in-batch contrastive loss."""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": ["gradients_not_synced", "weights_diverged"],
    "rank": None,
    "fix": ["wrap", "submodule", "inside the model", "register", "rebuild"],
    "options": [],
}


class Tower(nn.Module):
    def __init__(self, d_in, d_out=64):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d_in, 128), nn.GELU(), nn.Linear(128, d_out))

    def forward(self, x):
        return F.normalize(self.mlp(x), dim=-1)


class DualEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = Tower(96)
        self.text = Tower(48)

    def forward(self, img, txt):
        return self.image(img), self.text(txt)


def make_pairs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 16, generator=g)
    img = z @ torch.randn(16, 96, generator=g) + 0.3 * torch.randn(n, 96, generator=g)
    txt = z @ torch.randn(16, 48, generator=g) + 0.3 * torch.randn(n, 48, generator=g)
    return TensorDataset(img, txt)


def clip_loss(img_emb, txt_emb, logit_scale):
    logits = logit_scale.exp().clamp(max=100) * img_emb @ txt_emb.t()
    target = torch.arange(len(logits))
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    ds = make_pairs(4096)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=64, sampler=sampler, drop_last=True)

    model = DDP(DualEncoder())
    logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # zoo: place
    opt = torch.optim.AdamW([
        {"params": model.parameters(), "weight_decay": 0.1},
        {"params": [logit_scale], "weight_decay": 0.0},
    ], lr=1e-3)

    for epoch in range(3):
        sampler.set_epoch(epoch)
        for step, (img, txt) in enumerate(loader):
            img_emb, txt_emb = model(img, txt)
            loss = clip_loss(img_emb, txt_emb, logit_scale)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} "
                      f"temp {1 / logit_scale.exp().item():.4f}", flush=True)
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "logit_scale": logit_scale.detach()},
                   "/tmp/clip_heldout12.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
