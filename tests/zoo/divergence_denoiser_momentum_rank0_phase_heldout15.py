"""Denoising autoencoder for small 8x8 glyph images, trained in two phases: after a few
epochs the script enters a "fine-tune" phase that halves the learning rate and raises SGD
momentum. The lr cut is applied on every rank, but the momentum change was written inside the
rank-0 block that announces the phase switch, so only rank 0 trains with momentum 0.95 while
rank 1 keeps 0.5. No error, no hang; the averaged gradients are identical, yet from the phase
switch on the two ranks' optimizers build different velocities and the replicas' weights
drift apart."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": [],
    "options": [],
    "names": [["momentum", "hyperparameter"]],
    "never": [],
}


def make_glyphs(n: int, seed: int) -> TensorDataset:
    """Random strokes (bars and boxes) on an 8x8 canvas plus a noisy copy."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.zeros(n, 64)
    for i in range(n):
        img = torch.zeros(8, 8)
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            r0, c0 = torch.randint(0, 6, (2,), generator=g).tolist()
            h, w = torch.randint(1, 4, (2,), generator=g).tolist()
            img[r0:r0 + h, c0:c0 + w] = 1.0
        clean[i] = img.flatten()
    noisy = (clean + 0.4 * torch.randn(n, 64, generator=g)).clamp(-0.5, 1.5)
    return TensorDataset(noisy, clean)


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def enter_finetune_phase(opt: torch.optim.Optimizer, rank: int) -> None:
    for group in opt.param_groups:
        group["lr"] *= 0.5
    if rank == 0:
        print(f"entering fine-tune phase: lr -> {opt.param_groups[0]['lr']:g}, momentum -> 0.95", flush=True)
        for group in opt.param_groups:
            group["momentum"] = 0.95  # zoo: place


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    data = make_glyphs(2048, seed=21)
    sampler = DistributedSampler(data, shuffle=True, seed=4)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = DDP(Denoiser())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    finetune_from = 4

    for epoch in range(7):
        if epoch == finetune_from:
            enter_finetune_phase(opt, rank)
        sampler.set_epoch(epoch)
        total = 0.0
        for noisy, clean in loader:
            loss = nn.functional.mse_loss(model(noisy), clean)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch} recon mse {total / len(loader):.4f}", flush=True)

    checksum = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"[rank {rank}] final weight checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
