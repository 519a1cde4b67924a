"""Bird-migration stopover prediction with a frozen pretrained track encoder, 2-rank CPU DDP (healthy).

What the job does
    Linear-probe style fine-tuning: a GRU track encoder "pretrained" on GPS
    telemetry (here: saved once by rank 0 under the zoo output directory and
    loaded by every rank) is frozen with ``requires_grad_(False)`` *before*
    the model is wrapped in DDP, and only the stopover-region classifier head
    is trained. The encoder is used in every forward; since its parameters do
    not require grad, DDP does not register them for reduction, so nothing is
    waiting for gradients that never come. The optimizer only sees the
    trainable parameters.

Healthy twin of the "submodule that gets no gradient" pathologies: frozen
    weights that are used in forward are fine.

What a plain run shows
    torchrun ... --nproc_per_node 2 exits 0 after ~4-5 s wall, no errors or
    warnings; logs "trainable ... params, frozen ..." then 36 steps
    (3 epochs x 12), train accuracy rising to ~0.98, "done: 36 steps".
    An instrumented copy confirmed every trainable parameter had a gradient
    after every backward on both ranks.
"""
import math  # noqa: I001
import gc
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

EXPECT = None


@dataclass
class MigrationConfig:
    track_len: int = 48  # 6-hourly fixes over 12 days
    n_feats: int = 5  # dlat, dlon, altitude, ground speed, heading(sin)
    hidden: int = 64
    num_regions: int = 6  # candidate stopover regions along the flyway
    num_tracks: int = 768
    batch_size: int = 32
    epochs: int = 3
    lr: float = 3e-3
    seed: int = 5
    out_dir: str = field(
        default_factory=lambda: os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "bird_migration")
    )


class TelemetryTracks(Dataset):
    """Synthetic GPS tracks drifting toward one of several stopover regions."""

    def __init__(self, cfg: MigrationConfig):
        g = torch.Generator().manual_seed(cfg.seed)
        n, t = cfg.num_tracks, cfg.track_len
        self.region = torch.randint(0, cfg.num_regions, (n,), generator=g)
        bearing = (self.region.float() / cfg.num_regions) * math.pi - math.pi / 2
        tt = torch.linspace(0, 1, t).view(1, -1)
        speed = 8 + 4 * torch.rand(n, 1, generator=g) + 2 * torch.sin(6.28 * 3 * tt)
        dlat = speed * torch.cos(bearing).view(-1, 1) / 100 + 0.02 * torch.randn(n, t, generator=g)
        dlon = speed * torch.sin(bearing).view(-1, 1) / 100 + 0.02 * torch.randn(n, t, generator=g)
        alt = 0.5 + 0.3 * torch.sin(6.28 * 4 * tt) + 0.1 * torch.randn(n, t, generator=g)
        heading = torch.atan2(dlon, dlat)
        self.tracks = torch.stack([dlat * 10, dlon * 10, alt, speed / 10, torch.sin(heading)], dim=-1)

    def __len__(self):
        return len(self.region)

    def __getitem__(self, idx):
        return self.tracks[idx], self.region[idx]


class TrackEncoder(nn.Module):
    def __init__(self, n_feats, hidden):
        super().__init__()
        self.proj = nn.Linear(n_feats, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)

    def forward(self, tracks):
        out, h = self.gru(torch.tanh(self.proj(tracks)))
        return torch.cat([h.squeeze(0), out.mean(dim=1)], dim=1)


class StopoverClassifier(nn.Module):
    def __init__(self, cfg: MigrationConfig):
        super().__init__()
        self.encoder = TrackEncoder(cfg.n_feats, cfg.hidden)
        self.head = nn.Sequential(
            nn.LayerNorm(2 * cfg.hidden), nn.Linear(2 * cfg.hidden, cfg.hidden), nn.GELU(),
            nn.Dropout(0.1), nn.Linear(cfg.hidden, cfg.num_regions),
        )

    def forward(self, tracks):
        return self.head(self.encoder(tracks))


def load_pretrained_encoder(cfg: MigrationConfig, rank: int) -> TrackEncoder:
    """Rank 0 materialises the 'pretrained' checkpoint once; all ranks load it."""
    path = os.path.join(cfg.out_dir, "track_encoder_pretrained.pt")
    if rank == 0 and not os.path.exists(path):
        os.makedirs(cfg.out_dir, exist_ok=True)
        torch.manual_seed(1000)
        torch.save(TrackEncoder(cfg.n_feats, cfg.hidden).state_dict(), path)
    dist.barrier()
    enc = TrackEncoder(cfg.n_feats, cfg.hidden)
    enc.load_state_dict(torch.load(path, map_location="cpu"))
    return enc


def main():
    cfg = MigrationConfig()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)

    dataset = TelemetryTracks(cfg)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)

    model = StopoverClassifier(cfg)
    model.encoder.load_state_dict(load_pretrained_encoder(cfg, rank).state_dict())
    model.encoder.requires_grad_(False)  # linear probe: freeze before wrapping in DDP
    model = DDP(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr)
    if rank == 0:
        n_frozen = sum(p.numel() for p in model.module.encoder.parameters())
        print(f"trainable {sum(p.numel() for p in trainable)} params, frozen {n_frozen}", flush=True)

    step, t0 = 0, time.time()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        model.module.encoder.eval()
        correct = total = 0
        for tracks, region in loader:
            logits = model(tracks)
            loss = F.cross_entropy(logits, region, label_smoothing=0.05)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            correct += (logits.argmax(1) == region).sum().item()
            total += region.numel()
            if rank == 0 and step % 6 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f}", flush=True)
            step += 1
        stats = torch.tensor([correct, total], dtype=torch.float64)
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} train acc {stats[0] / stats[1]:.3f}", flush=True)

    if rank == 0:
        torch.save(model.module.head.state_dict(), os.path.join(cfg.out_dir, "stopover_head.pt"))
        print(f"done: {step} steps in {time.time() - t0:.1f}s", flush=True)
    dist.barrier()  # let rank 0 finish writing before tearing down gloo
    del model, optimizer  # drop DDP (and its handle on the gloo group) before teardown
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
