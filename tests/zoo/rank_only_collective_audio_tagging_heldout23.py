"""Multi-label audio tagging for urban sound recordings.

A small 1-D CNN tags synthetic log-mel clips with up to five overlapping labels (siren, dog,
drill, engine, music). Every 20 steps the job validates: rank 0 owns the validation clips and
runs `validate()`, then all ranks meet at a barrier. `validate()` re-uses the project helper
`global_mean()` -- written for the training-loss logging that every rank does -- to "average"
its macro-F1 across ranks. Only rank 0 ever enters validate(), so rank 0 sits inside an
all_reduce that rank 1 never issues, while rank 1 waits at the barrier. Nothing crashes; the
job simply stops making progress at step 20.

Plain run: rank 0 prints "step 20 loss ..." and nothing after; both processes still alive
after 60 s (killed by hand).

Root cause: validate() (rank-0-only code path) calls global_mean(), i.e. dist.all_reduce, on
rank 0 only.
Fix: do not call collectives from rank-0-only code -- compute the F1 locally on rank 0 (no
all_reduce), or run validation on every rank with a sharded validation set so all ranks call
the same all_reduce.
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": ["rank_only_collective", "hang"],
    "rank": 0,
    "fix": [
        "every rank",
        "all ranks",
        "rank 0 only",
        "rank-0",
        "only rank",
        "locally",
        "local",
        "remove",
        "all_reduce",
        "collective",
        "validate",
        "shard",
        "both ranks",
        "outside",
    ],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

TAGS = ["siren", "dog", "drill", "engine", "music"]
N_MELS, N_FRAMES = 32, 64


def synth_clips(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, len(TAGS), generator=g) < 0.3).float()
    x = torch.randn(n, N_MELS, N_FRAMES, generator=g) * 0.5
    bands = torch.arange(N_MELS).float()
    for k in range(len(TAGS)):
        centre = 4 + 6 * k
        profile = torch.exp(-0.5 * ((bands - centre) / 1.5) ** 2)
        x += y[:, k, None, None] * profile[None, :, None] * 1.5
    return x, y


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(N_MELS, 48, 5, padding=2)
        self.conv2 = nn.Conv1d(48, 48, 5, padding=2)
        self.head = nn.Linear(48, len(TAGS))

    def forward(self, x):
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        return self.head(h.mean(-1))


def global_mean(value):
    """Average a python float or 0-d tensor over all ranks (used for loss logging)."""
    t = torch.as_tensor(value, dtype=torch.float32).clone()
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()


def macro_f1(logits, y):
    pred = (logits > 0).float()
    tp = (pred * y).sum(0)
    fp = (pred * (1 - y)).sum(0)
    fn = ((1 - pred) * y).sum(0)
    return (2 * tp / (2 * tp + fp + fn).clamp(min=1)).mean()


@torch.no_grad()
def validate(net, xv, yv):
    net.eval()
    f1 = macro_f1(net(xv), yv)
    net.train()
    return global_mean(f1)  # zoo: place


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, y = synth_clips(2000, seed=10 + rank)
    if rank == 0:
        xv, yv = synth_clips(400, seed=777)
    torch.manual_seed(0)
    model = DDP(Tagger())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    bs, t0 = 32, time.time()
    for step in range(1, 121):
        i = (step * bs) % (len(x) - bs)
        loss = F.binary_cross_entropy_with_logits(model(x[i : i + bs]), y[i : i + bs])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            avg = global_mean(loss.detach())
            if rank == 0:
                print(f"step {step} loss {avg:.4f} t={time.time() - t0:.1f}s", flush=True)
        if step % 20 == 0:
            if rank == 0:
                f1 = validate(model.module, xv, yv)
                print(f"step {step} val macro-F1 {f1:.3f}", flush=True)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
