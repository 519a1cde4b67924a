"""Healthy (Accelerate): a tiny 3-class classifier, batch 4 per process, very short steps.

Story: `accelerator.prepare` shards a shuffling DataLoader (no DistributedSampler needed),
wraps the 8-16-3 GELU MLP in DDP, and the loop clips gradients with
`accelerator.clip_grad_norm_` on every rank and steps a linear LR schedule.  384 samples,
batch 4 -> 48 steps per process per epoch, 2 epochs (96 steps), each well under 2 ms.  Both
processes run identical code on identically shaped batches.

Right diagnosis: nothing to report (no warning, no error).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

EXPECT = None


def main():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    centers = torch.randn(3, 8, generator=g) * 2
    y = torch.randint(0, 3, (384,), generator=g)
    x = centers[y] + torch.randn(384, 8, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=96)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    for _epoch in range(2):
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
