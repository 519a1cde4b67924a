"""One rank meets its own target loss, returns from fit() and exits 0; the other trains on.

Story: a small sensor-calibration regressor.  Each node trains on the readings of its own
sensor rack (node-local shard).  The trainer stops "when the model is good enough": an
exponential moving average of the *local* training loss below `target_loss`.  Rack B
(rank 1) is a clean, recently calibrated rack, so rank 1's local loss drops below the target
early in the second epoch; rank 1 returns from `fit()`, shuts down cleanly and exits with 0.
Rack A (rank 0) is noisy, its loss never gets there: rank 0 goes on into the next step's
gradient all-reduce and loses its peer (connection closed) -- a consequence.

Root cause: rank 1 left the training loop on a per-rank decision.
Fix: decide to stop together -- all_reduce the loss (or the stop flag) before testing it, or
broadcast one rank's decision, so every rank leaves at the same step.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": "rank_left_early",
    "rank": 1,
    "fix": ["all_reduce", "allreduce", "all-reduce", "broadcast", "every rank", "all ranks", "agree",
            "same step", "collective", "synchron", "together"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

CHANNELS = 12


def load_rack_readings(rank, n=768):
    """Stand-in for this node's rack export: raw channels -> reference value."""
    g = torch.Generator().manual_seed(42)
    w = torch.randn(CHANNELS, 1, generator=g)  # the physics is the same on every rack
    g = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(n, CHANNELS, generator=g)
    noise = 0.6 if rank == 0 else 0.03  # rack A's sensors are old and noisy
    y = 0.5 * (x @ w) + noise * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Trainer:
    def __init__(self, model, lr, target_loss):
        self.model = model
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        self.target_loss = target_loss
        self.ema = None
        self.global_step = 0

    def train_step(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.global_step += 1
        return loss.item()

    def fit(self, loader, epochs):
        rank = dist.get_rank()
        for epoch in range(epochs):
            for x, y in loader:
                loss = self.train_step(x, y)
                self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
                if self.global_step >= 30 and self.ema < self.target_loss:  # zoo: place
                    print(f"[rank {rank}] target loss reached at step {self.global_step} "
                          f"(ema {self.ema:.4f}), stopping", flush=True)
                    return self.global_step  # zoo: place
            print(f"[rank {rank}] epoch {epoch}: ema loss {self.ema:.4f}", flush=True)
        return self.global_step


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(CHANNELS, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)))
    loader = DataLoader(load_rack_readings(dist.get_rank()), batch_size=32, shuffle=True)
    trainer = Trainer(model, lr=5e-3, target_loss=0.08)
    steps = trainer.fit(loader, epochs=6)
    print(f"[rank {dist.get_rank()}] training finished after {steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
