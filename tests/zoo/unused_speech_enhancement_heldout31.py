"""Speech enhancement with a voice-activity auxiliary head, 2-rank CPU DDP (gloo).

What the job does
    Trains a small convolutional mask estimator on synthetic noisy magnitude
    spectrograms (harmonic "speech" frames + broadband noise). The model
    predicts a time-frequency mask (enhanced = mask * noisy) and, from the same
    encoder features, per-frame voice-activity logits that were meant to be an
    auxiliary target.

Root cause
    SpeechEnhancer.forward returns a tuple ``(enhanced, vad_logits)``. The
    training loop unpacks it as ``enhanced, _ = model(noisy)`` and only
    computes the spectral L1 loss, so the ``vad_head`` parameters never take
    part in the loss. DDP is built with find_unused_parameters=False, so its
    reducer waits for gradients of vad_head that never arrive, and the next
    forward raises "Expected to have finished reduction in the prior iteration
    before starting a new one".

Fix
    Use the second output: add the VAD loss
    (``F.binary_cross_entropy_with_logits(vad_logits, vad)``, weighted by
    cfg.vad_weight) to the loss. Alternatively drop vad_head from the model
    while it is not trained, or (slower) pass find_unused_parameters=True.

What a plain run shows
    torchrun ... --nproc_per_node 2 exits 1 (ChildFailedError) after ~4-5 s wall.
    Step 0 trains and logs; on step 1 BOTH ranks raise from DDP._pre_forward at
    `enhanced, _ = model(noisy)`: "RuntimeError: Expected to have finished
    reduction in the prior iteration before starting a new one. ..." with
    "Parameter indices which did not receive grad for rank N: 6 7 8 9"
    (vad_head.0/vad_head.2 weight+bias). Both ranks fail at the same step;
    torchrun's "Root Cause (first observed failure)" names whichever exited
    first (rank 0 in most runs, rank 1 in some).
"""
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = {
    "kind": ["unused_parameters"],
    "rank": None,
    "fix": ["find_unused_parameters", "vad_head", "vad"],
    "options": [],
}


@dataclass
class EnhanceConfig:
    n_freq: int = 64
    n_frames: int = 32
    hidden: int = 96
    num_clips: int = 512
    batch_size: int = 16
    epochs: int = 2
    lr: float = 2e-3
    snr_db: float = 5.0
    vad_weight: float = 0.2
    seed: int = 1234
    log_every: int = 5
    out_dir: str = field(
        default_factory=lambda: os.path.join(
            tempfile.gettempdir(), "ddpdoctor-zoo", "speech_enhancement"
        )
    )


class NoisySpeechDataset(Dataset):
    """Synthetic magnitude spectrograms: harmonic frames plus broadband noise."""

    def __init__(self, cfg: EnhanceConfig, seed: int):
        g = torch.Generator().manual_seed(seed)
        n = cfg.num_clips
        f0 = torch.randint(4, 12, (n, 1, 1), generator=g).float()
        freqs = torch.arange(cfg.n_freq).float().view(1, -1, 1)
        harmonics = torch.exp(-((freqs % f0) ** 2) / 2.0)  # (n, F, 1)
        active = (torch.rand(n, 1, cfg.n_frames, generator=g) > 0.35).float()
        envelope = active * (0.5 + torch.rand(n, 1, cfg.n_frames, generator=g))
        self.clean = harmonics * envelope  # (n, F, T)
        noise_scale = 10 ** (-cfg.snr_db / 20)
        noise = noise_scale * torch.rand(n, cfg.n_freq, cfg.n_frames, generator=g)
        self.noisy = self.clean + noise
        self.vad = active.squeeze(1)  # (n, T)

    def __len__(self):
        return self.noisy.shape[0]

    def __getitem__(self, idx):
        return self.noisy[idx], self.clean[idx], self.vad[idx]


class SpeechEnhancer(nn.Module):
    def __init__(self, cfg: EnhanceConfig):
        super().__init__()
        h = cfg.hidden
        self.encoder = nn.Sequential(
            nn.Conv1d(cfg.n_freq, h, kernel_size=3, padding=1),
            nn.GELU(),
            nn.Conv1d(h, h, kernel_size=3, padding=1),
            nn.GELU(),
        )
        self.mask_head = nn.Conv1d(h, cfg.n_freq, kernel_size=1)
        self.vad_head = nn.Sequential(
            nn.Conv1d(h, h // 2, kernel_size=1),
            nn.GELU(),
            nn.Conv1d(h // 2, 1, kernel_size=1),
        )

    def forward(self, noisy):
        feats = self.encoder(torch.log1p(noisy))
        mask = torch.sigmoid(self.mask_head(feats))
        enhanced = mask * noisy
        vad_logits = self.vad_head(feats).squeeze(1)
        return enhanced, vad_logits


def spectral_loss(enhanced, clean):
    """L1 on log-compressed magnitudes, the usual perceptual-ish proxy."""
    return F.l1_loss(torch.log1p(enhanced), torch.log1p(clean))


def snr_improvement(noisy, enhanced, clean):
    def snr(est):
        err = (est - clean).pow(2).sum(dim=(1, 2)) + 1e-8
        return 10 * torch.log10(clean.pow(2).sum(dim=(1, 2)) / err)

    return (snr(enhanced) - snr(noisy)).mean().item()


def setup_distributed():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


def train(cfg: EnhanceConfig):
    rank, world = setup_distributed()
    torch.manual_seed(cfg.seed)
    dataset = NoisySpeechDataset(cfg, seed=cfg.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)

    model = DDP(SpeechEnhancer(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)

    step = 0
    t0 = time.time()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for noisy, clean, vad in loader:  # noqa: B007
            enhanced, _ = model(noisy)  # zoo: place
            loss = spectral_loss(enhanced, clean)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()

            if rank == 0 and step % cfg.log_every == 0:
                gain = snr_improvement(noisy, enhanced.detach(), clean)
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} "
                      f"snr_gain {gain:+.2f} dB", flush=True)
            step += 1

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "enhancer.pt"))
        print(f"done: {step} steps in {time.time() - t0:.1f}s", flush=True)
    dist.barrier()  # let rank 0 finish writing before tearing down gloo
    dist.destroy_process_group()


if __name__ == "__main__":
    train(EnhanceConfig())
