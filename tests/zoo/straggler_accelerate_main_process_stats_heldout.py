"""(Accelerate) The main process computes and writes per-layer training statistics on every
step (short-step straggler, rank 0).

Story: a small regression MLP (10-32-32-32-1, SiLU) trained with Accelerate on the CPU,
batch 8 per process, 640 rows -> 40 steps per process per epoch, 2 epochs (80 steps, ~1-2 ms
each).  For a dashboard the author added a "training health" logger guarded by
`accelerator.is_main_process` -- correct in that it contains no collective -- and called it
after every `optimizer.step()` with `log_every=1` left over from debugging: for every parameter
it computes the weight norm, gradient norm, the update-to-weight ratio (keeping a copy of the
previous weights), the fraction of exactly-zero gradients, a gradient 99th percentile, the
largest weight and 16-bin weight/gradient histograms, all pulled to Python with `.item()` /
`.tolist()`, then appends a JSON line to a file.  That is roughly 1-2 ms of host work on rank 0
per step; rank 1 finishes its step and then waits for rank 0 in the next gradient all-reduce.
No error, the job is just slower.

Root cause: rank 0 (extra per-step host work after the optimizer step: the stats logger).
Right diagnosis: straggler, rank 0, slow between steps (outside forward/backward); rank 1
waits in the all-reduce.
Fix: log the statistics every N steps (e.g. 50-100) rather than every step, or compute them
with fewer host syncs / in the background.
"""

import json
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": "straggler",
    "rank": 0,
    "fix": ["log", "every n", "less often", "less frequent", "interval", "frequen",
            "background", "async"],
    "options": [],
}

CONFIG = {"log_every": 1, "epochs": 2, "batch_size": 8}


class HealthLogger:
    def __init__(self, model, path):
        self.path = path
        self.prev = {n: p.detach().clone() for n, p in model.named_parameters()}

    def log(self, step, model, loss):
        rec = {"step": step, "loss": loss.item()}
        for name, p in model.named_parameters():  # zoo: place
            w_norm = p.detach().norm().item()
            g_norm = p.grad.norm().item()
            update = (p.detach() - self.prev[name]).norm().item()
            rec[name] = {
                "w": w_norm,
                "g": g_norm,
                "upd_ratio": update / (w_norm + 1e-12),
                "g_zero_frac": (p.grad == 0).float().mean().item(),
                "g_p99": torch.quantile(p.grad.abs().flatten(), 0.99).item(),
                "w_absmax": p.detach().abs().max().item(),
                "w_hist": torch.histc(p.detach(), bins=16).tolist(),
                "g_hist": torch.histc(p.grad, bins=16).tolist(),
            }
            self.prev[name].copy_(p.detach())
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def main():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(640, 10, generator=g)
    y = torch.sin(x[:, :1] * 2) + x[:, 1:2] * x[:, 2:3] + 0.05 * torch.randn(640, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=CONFIG["batch_size"], shuffle=True)
    model = nn.Sequential(nn.Linear(10, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU(),
                          nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    logger = None
    if accelerator.is_main_process:
        path = os.path.join(tempfile.mkdtemp(prefix="health_"), "health.jsonl")
        logger = HealthLogger(accelerator.unwrap_model(model), path)
    step = 0
    for _epoch in range(CONFIG["epochs"]):
        for xb, yb in loader:
            loss = F.mse_loss(model(xb), yb)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            step += 1
            if logger is not None and step % CONFIG["log_every"] == 0:
                logger.log(step, accelerator.unwrap_model(model), loss)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
