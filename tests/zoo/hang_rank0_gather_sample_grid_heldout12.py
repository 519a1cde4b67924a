"""Denoising autoencoder on synthetic 8x8 blob images, 2 ranks with a DistributedSampler.
Every 25 steps rank 0 dumps a grid of reconstructions, and the dump helper collects a few
samples from every rank with dist.gather. Only rank 0 calls the helper, so its gather has no
partner: rank 1 goes on to the next step's gradient all-reduce and the job hangs."""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": ["rank_only_collective", "hang"],
    "rank": 0,
    "fix": ["every rank", "all ranks", "outside"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

SAMPLE_EVERY = 25


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


def write_sample_grid(noisy, recon, step, rank, world):
    """Collect 4 reconstructions from every rank on rank 0 and write them as an ASCII grid."""
    local = torch.cat([noisy[:4], recon[:4]]).detach().contiguous()
    gathered = [torch.empty_like(local) for _ in range(world)] if rank == 0 else None
    dist.gather(local, gathered, dst=0)  # zoo: place
    if rank != 0:
        return
    shades = " .:-=+*#%@"
    lines = []
    for img in torch.cat(gathered).view(-1, 8, 8):
        for row in img.clamp(0, 1):
            lines.append("".join(shades[int(v * 9)] for v in row))
        lines.append("")
    path = os.path.join(tempfile.gettempdir(), f"dae_samples_step{step:05d}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    images = make_blobs(2048)
    ds = TensorDataset(images)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, drop_last=True)

    model = DDP(DenoisingAE())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    step = 0
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for (clean,) in loader:
            noisy = clean + 0.2 * torch.randn_like(clean)
            recon = model(noisy)
            loss = F.mse_loss(recon, clean)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step > 0 and step % SAMPLE_EVERY == 0:
                write_sample_grid(noisy, recon, step, rank, world)
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            step += 1
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(tempfile.gettempdir(), "dae.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
