"""Denoising autoencoder on synthetic 8x8 blob images, 2 ranks with a DistributedSampler.
Every 25 steps rank 0 renders a preview grid of reconstructions of a fixed held-out batch.
Healthy: the preview runs model.module under no_grad on rank 0's own data and issues no
collective, and it takes about a millisecond, so nobody waits for it."""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

PREVIEW_EVERY = 25


class DenoisingAE(nn.Module):
    def __init__(self, dim=64, hidden=128, code=16):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, code))
        self.dec = nn.Sequential(nn.Linear(code, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, x):
        return self.dec(self.enc(x))


def make_blobs(n, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    centres = torch.rand(n, 2, generator=g) * (size - 1)
    widths = 0.8 + torch.rand(n, 1, 1, generator=g) * 1.5
    d2 = (ys - centres[:, 0, None, None]) ** 2 + (xs - centres[:, 1, None, None]) ** 2
    return torch.exp(-d2 / (2 * widths ** 2)).view(n, -1)


@torch.no_grad()
def write_preview(net, noisy, step):
    """Render noisy inputs and their reconstructions side by side as an ASCII grid."""
    was_training = net.training
    net.eval()
    recon = net(noisy)
    net.train(was_training)
    shades = " .:-=+*#%@"
    lines = []
    pairs = zip(noisy.view(-1, 8, 8).clamp(0, 1).tolist(), recon.view(-1, 8, 8).clamp(0, 1).tolist())
    for a, b in pairs:
        for ra, rb in zip(a, b):
            lines.append("".join(shades[int(v * 9)] for v in ra) + "  " + "".join(shades[int(v * 9)] for v in rb))
        lines.append("")
    path = os.path.join(tempfile.gettempdir(), f"dae_preview_step{step:05d}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    ds = TensorDataset(make_blobs(2048))
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, drop_last=True)
    preview_batch = make_blobs(4, seed=99)
    preview_batch = preview_batch + 0.2 * torch.randn(preview_batch.shape, generator=torch.Generator().manual_seed(5))

    model = DDP(DenoisingAE())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    step = 0
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for (clean,) in loader:
            noisy = clean + 0.2 * torch.randn_like(clean)
            loss = F.mse_loss(model(noisy), clean)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step > 0 and step % PREVIEW_EVERY == 0:
                write_preview(model.module, preview_batch, step)
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            step += 1
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(tempfile.gettempdir(), "dae_preview.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
