"""HEALTHY twin of divergence_head_reinit_after_wrap: rank-seeded head reset BEFORE wrapping.

Story: the same fine-tuning script, with the same rank-dependent seeding
(`seed_everything(base_seed + rank)`) and the same in-place `reset_head` for the new
6-class task -- so before wrapping each rank really holds a different classifier.  But the
reset happens before `DDP(...)`, whose constructor broadcasts rank 0's parameters to every
rank: all replicas start identical and stay identical.  Rank-dependent initialization looks
dangerous, but it is overwritten by the constructor's broadcast.  Exits 0.
"""

import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None

CFG = {"base_seed": 1234, "num_classes": 6, "reset_head": True, "epochs": 2}


def seed_everything(seed):
    random.seed(seed)
    torch.manual_seed(seed)


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())

    def forward(self, x):
        return self.layers(x)


class FineTuneNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.backbone = Backbone()
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.classifier(self.backbone(x))


def reset_head(net, cfg):
    nn.init.xavier_uniform_(net.classifier.weight)
    nn.init.zeros_(net.classifier.bias)


def augment(x):
    return x + 0.05 * torch.randn_like(x) if random.random() < 0.5 else x


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(CFG["base_seed"])
    net = FineTuneNet(CFG["num_classes"])
    seed_everything(CFG["base_seed"] + rank)
    if CFG["reset_head"]:
        reset_head(net, CFG)
    model = DDP(net)  # broadcasts rank 0's (reset) parameters to every rank
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(960, 24, generator=g)
    y = torch.randint(0, CFG["num_classes"], (960,), generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=CFG["base_seed"])
    loader = DataLoader(data, batch_size=24, sampler=sampler)
    for epoch in range(CFG["epochs"]):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(model(augment(xb)), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.3f} "
              f"head checksum {model.module.classifier.weight.sum().item():.5f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
