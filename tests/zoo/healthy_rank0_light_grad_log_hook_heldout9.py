"""HEALTHY: rank 0 logs gradient norms from a hook -- a few percent of a step, no more.

Story: an MLP classifier (64-384-384-10, batch 96).  Rank 0 registers `GradNormLog.hook` on
each weight with `param.register_hook`: the hook computes the gradient's norm and
largest magnitude and appends one formatted line per weight to a buffered log file (no
flush, no fsync; the file object flushes itself now and then).  This costs rank 0 about
0.5 ms of a ~9-10 ms step (~5%, measured on 2 busy CPU cores), so rank 1 reaches each
gradient all-reduce a little earlier -- a small, steady imbalance that is not worth
reporting.  DistributedSampler + set_epoch, AdamW with a cosine schedule, 3 epochs.

Right diagnosis: nothing to report (no warning, no error).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None


class GradNormLog:
    def __init__(self, path):
        self.f = open(path, "w")  # noqa: SIM115 - open for the run
        self.step = 0

    def hook(self, name):
        def fn(grad):
            norm, peak = grad.norm().item(), grad.abs().max().item()
            self.f.write(f"{self.step} {name} {norm:.6f} {peak:.6f}\n")
            return grad
        return fn


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(9)
    protos = torch.randn(10, 64, generator=g)
    y = torch.randint(0, 10, (3072,), generator=g)
    data = TensorDataset(protos[y] + torch.randn(3072, 64, generator=g), y)
    sampler = DistributedSampler(data, seed=2)
    loader = DataLoader(data, batch_size=96, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(64, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(),
                              nn.Linear(384, 10)))
    log = None
    if rank == 0:
        log = GradNormLog(os.path.join(tempfile.mkdtemp(), "grad_norms.log"))
        for name, p in model.module.named_parameters():
            if name.endswith("weight"):
                p.register_hook(log.hook(name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3 * len(loader))
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            sched.step()
            if log is not None:
                log.step += 1
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
    if log is not None:
        log.f.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
