"""Healthy twin: early stopping on an all-reduced validation loss; every rank returns together.

Story: a keyword-spotting trainer (`Trainer.fit`, epochs -> batches) validates every 10
steps.  Each rank scores its own validation shard, but the helper all-reduces the loss sum
and the sample count before dividing, so every rank sees the same global validation loss.
An `EarlyStopping` object (patience 3, on the global value) then tells each rank to stop at
the same check, and every rank leaves through the same `return` inside the nested loop,
then meets the others at the final barrier.

Expected: no warning, no error.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None


class EarlyStopping:
    def __init__(self, patience=3, min_delta=1e-3):
        self.patience = patience
        self.min_delta = min_delta
        self.best = float("inf")
        self.stale = 0

    def step(self, value):
        if value < self.best - self.min_delta:
            self.best, self.stale = value, 0
        else:
            self.stale += 1
        return self.stale >= self.patience


class Trainer:
    def __init__(self, model, loader, sampler, val, rank):
        self.model = model
        self.loader = loader
        self.sampler = sampler
        self.val_x, self.val_y = val
        self.rank = rank
        self.opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        self.stopper = EarlyStopping()

    @torch.no_grad()
    def global_val_loss(self):
        self.model.eval()
        loss_sum = F.cross_entropy(self.model.module(self.val_x), self.val_y, reduction="sum")
        totals = torch.stack([loss_sum, torch.tensor(float(len(self.val_y)))])
        dist.all_reduce(totals)
        self.model.train()
        return (totals[0] / totals[1]).item()

    def fit(self, max_epochs=20, check_every=10):
        step = 0
        for epoch in range(max_epochs):
            self.sampler.set_epoch(epoch)
            for xb, yb in self.loader:
                loss = F.cross_entropy(self.model(xb), yb)
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                step += 1
                if step % check_every == 0:
                    val = self.global_val_loss()
                    if self.rank == 0:
                        print(f"epoch {epoch} step {step} train {loss.item():.4f} val {val:.4f}",
                              flush=True)
                    if self.stopper.step(val):
                        if self.rank == 0:
                            print(f"early stop at step {step} (best {self.stopper.best:.4f})",
                                  flush=True)
                        return step
        return step


def keyword_frames(seed, n):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 5, (n,), generator=g)
    x = torch.randn(n, 40, generator=g) * 1.5
    x[torch.arange(n), y * 8] += 2.0
    return x, y


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(40, 96), nn.ReLU(), nn.Linear(96, 5)))
    x, y = keyword_frames(1, 1024)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    trainer = Trainer(model, loader, sampler, keyword_frames(100 + rank, 128), rank)
    steps = trainer.fit()
    print(f"[rank {rank}] stopped after {steps} steps", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/kws_best.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
