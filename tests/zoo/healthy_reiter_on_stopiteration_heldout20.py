"""Healthy twin: an "endless" loader that re-creates iter(loader) on StopIteration.

Story: a denoising autoencoder for 12x12 grey image patches, trained for a step budget with a
log line every 16 steps.  A `BatchSource` object holds one DataLoader iterator in an
attribute (`self._it = iter(loader)`, made once in the constructor, like the stream of the
replaying jobs) and hands out batches with `next()`.  When the iterator runs dry it catches
StopIteration, advances the sampler with `set_epoch(epoch + 1)` and opens a new pass with
`iter(self.loader)`.  Every epoch therefore draws a new DistributedSampler permutation.
Nothing is wrong here.
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

PATCH = 12


class Patches(Dataset):
    """Smooth synthetic patches (sums of oriented gratings) plus per-sample noise."""

    def __init__(self, n=1152, seed=8, noise=0.35):
        g = torch.Generator().manual_seed(seed)
        yy, xx = torch.meshgrid(torch.arange(PATCH).float(), torch.arange(PATCH).float(),
                                indexing="ij")
        angle = torch.rand(n, 2, generator=g) * 3.1416
        freq = 0.3 + 0.6 * torch.rand(n, 2, generator=g)
        clean = torch.zeros(n, PATCH, PATCH)
        for k in range(2):
            a = angle[:, k].view(-1, 1, 1)
            f = freq[:, k].view(-1, 1, 1)
            clean += torch.cos(f * (xx * torch.cos(a) + yy * torch.sin(a)))
        self.clean = (clean / 2).unsqueeze(1)
        self.noisy = self.clean + noise * torch.randn(self.clean.shape, generator=g)

    def __len__(self):
        return len(self.clean)

    def __getitem__(self, i):
        return self.noisy[i], self.clean[i]


class DAE(nn.Module):
    def __init__(self, ch=24):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, ch, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(ch, ch, 3, stride=2, padding=1), nn.ReLU())
        self.dec = nn.Sequential(nn.ConvTranspose2d(ch, ch, 4, stride=2, padding=1), nn.ReLU(),
                                 nn.Conv2d(ch, 1, 3, padding=1))

    def forward(self, x):
        return self.dec(self.enc(x))


class BatchSource:
    """Hands out training batches forever; a new sampler epoch at every wrap-around."""

    def __init__(self, loader, sampler):
        self.loader, self.sampler = loader, sampler
        self.epoch = 0
        self.sampler.set_epoch(self.epoch)
        self._it = iter(loader)

    def next(self):
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self._it = iter(self.loader)
            return next(self._it)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    data = Patches()
    sampler = DistributedSampler(data, shuffle=True, seed=17)
    loader = DataLoader(data, batch_size=36, sampler=sampler, drop_last=True)
    source = BatchSource(loader, sampler)

    model = DDP(DAE())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    max_steps = 5 * len(loader)
    for step in range(max_steps):
        noisy, clean = source.next()
        loss = F.mse_loss(model(noisy), clean)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and step % 16 == 0:
            print(f"step {step} epoch {source.epoch}: mse {loss.item():.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
