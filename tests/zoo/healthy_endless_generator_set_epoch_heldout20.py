"""Healthy twin: a step-based trainer fed by an infinite generator that reshuffles per pass.

Story: a keyword-spotting model (a small 1-D conv net over synthetic MFCC frames) trained for
a fixed number of optimizer steps.  Like the itertools.cycle / tee / list(loader) jobs, the
trainer pulls batches with `next()` from a stream it creates once, before the loop.  But the
stream is a generator that, each time the loader is exhausted, calls
`sampler.set_epoch(epoch)` and starts a new pass with `for batch in loader`: every epoch is a
fresh DistributedSampler order, on every rank.  Nothing is wrong here.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = None

KEYWORDS = ["yes", "no", "up", "down", "left", "right", "stop", "go", "_silence_", "_unknown_"]
N_MFCC, FRAMES = 13, 40


class SpokenKeywords(Dataset):
    def __init__(self, n=1280, seed=4):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, len(KEYWORDS), (n,), generator=g)
        templates = torch.randn(len(KEYWORDS), N_MFCC, FRAMES, generator=g)
        shift = torch.randint(-4, 5, (n,), generator=g)
        self.feats = torch.stack([
            torch.roll(templates[c], int(s), dims=1) for c, s in zip(self.labels, shift)
        ]) + 0.5 * torch.randn(n, N_MFCC, FRAMES, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.feats[i], self.labels[i]


class KWSNet(nn.Module):
    def __init__(self, width=48):
        super().__init__()
        self.conv1 = nn.Conv1d(N_MFCC, width, 5, padding=2)
        self.conv2 = nn.Conv1d(width, width, 5, padding=2, dilation=1)
        self.conv3 = nn.Conv1d(width, width, 3, padding=2, dilation=2)
        self.cls = nn.Linear(width, len(KEYWORDS))

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x)) + x
        x = F.relu(self.conv3(x)) + x
        return self.cls(x.mean(-1))


def forever(loader, sampler, start_epoch=0):
    """Yield (epoch, batch) without end; each pass of the loader gets its own shuffle."""
    epoch = start_epoch
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


def train(model, loader, sampler, total_steps, log_every=20):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=total_steps)
    stream = forever(loader, sampler)
    running = 0.0
    for step in range(total_steps):
        epoch, (x, y) = next(stream)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        running = 0.9 * running + 0.1 * loss.item() if step else loss.item()
        if dist.get_rank() == 0 and step % log_every == 0:
            print(f"step {step:4d} epoch {epoch}: loss {running:.3f}", flush=True)


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = SpokenKeywords()
    sampler = DistributedSampler(data, shuffle=True, seed=2)
    loader = DataLoader(data, batch_size=40, sampler=sampler, drop_last=True)
    model = DDP(KWSNet())
    train(model, loader, sampler, total_steps=5 * len(loader))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
