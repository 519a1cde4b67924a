"""Healthy twin of hang_zero_consolidate_rank0: every rank calls consolidate_state_dict.

Story: the click-through model trained with `ZeroRedundancyOptimizer` (sharded AdamW).  The
checkpoint helper calls `self.opt.consolidate_state_dict(to=0)` on EVERY rank -- it is a
collective in which each shard owner broadcasts its part of the optimizer state -- and only
the `torch.save` of the consolidated state is guarded by `if self.rank == 0`.  Checkpoints are
written at the end of epochs 1, 3 and 5 and the job finishes normally.

Right diagnosis: nothing wrong (rank-0-only file writing is fine; the collective is joined by
all ranks).
"""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = None

N_CAT, EMB, N_DENSE = 500, 16, 8


def click_logs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    cats = torch.randint(0, N_CAT, (n, 3), generator=g)
    dense = torch.randn(n, N_DENSE, generator=g)
    logit = dense[:, 0] - 0.5 * dense[:, 1] + (cats[:, 0] % 7 == 0).float()
    clicks = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    return TensorDataset(cats, dense, clicks)


class CTRModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(N_CAT, EMB, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(EMB + N_DENSE, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, cats, dense):
        return self.mlp(torch.cat([self.emb(cats), dense], 1)).squeeze(1)


class Trainer:
    def __init__(self, rank, world, ckpt_dir):
        self.rank = rank
        torch.manual_seed(0)
        self.model = DDP(CTRModel())
        self.opt = ZeroRedundancyOptimizer(self.model.parameters(),
                                           optimizer_class=torch.optim.AdamW, lr=3e-3)
        ds = click_logs(2048)
        self.sampler = DistributedSampler(ds, world, rank, shuffle=True)
        self.loader = DataLoader(ds, batch_size=64, sampler=self.sampler)
        self.ckpt_dir = ckpt_dir

    def save_checkpoint(self, epoch):
        self.opt.consolidate_state_dict(to=0)  # a collective: every rank takes part
        if self.rank == 0:
            torch.save({"epoch": epoch, "model": self.model.module.state_dict(),
                        "optim": self.opt.state_dict()},
                       os.path.join(self.ckpt_dir, f"ctr-{epoch}.pt"))
            print(f"saved checkpoint for epoch {epoch}", flush=True)

    def fit(self, epochs, ckpt_every=2):
        for epoch in range(epochs):
            self.sampler.set_epoch(epoch)
            total = 0.0
            for cats, dense, clicks in self.loader:
                loss = F.binary_cross_entropy_with_logits(self.model(cats, dense), clicks)
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                total += loss.item()
            print(f"rank {self.rank} epoch {epoch} loss {total / len(self.loader):.4f}",
                  flush=True)
            if (epoch + 1) % ckpt_every == 0:
                self.save_checkpoint(epoch)


def main():
    dist.init_process_group("gloo")
    ckpt_dir = os.path.join(tempfile.gettempdir(), f"ctr-ckpt-{os.environ['MASTER_PORT']}")
    os.makedirs(ckpt_dir, exist_ok=True)
    Trainer(dist.get_rank(), dist.get_world_size(), ckpt_dir).fit(epochs=6)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
