"""Isolated sign-language gloss recognition from pose keypoints with a scheduled hand branch, 2-rank CPU DDP (healthy).

What the job does
    Trains a temporal-conv classifier on synthetic pose-keypoint sequences
    (body + two hands, 2D coordinates) to recognise one of 10 glosses. A
    fine-grained hand-shape branch (``hand_branch``) is phased in by a
    curriculum: it is "off" for the first cfg.hand_warmup_steps steps and then
    ramps up to full weight.

Why it is healthy
    The branch is *computed on every step* and its output is multiplied by a
    scheduled gate (0.0 while off): ``h = h + gate * self.hand_branch(hands)``.
    A zero gate still puts the branch's parameters in the autograd graph, so
    they receive a (zero) gradient every step, DDP's reducer sees every
    parameter, and the default find_unused_parameters=False is correct.

Healthy twin of the "branch enabled by a step-dependent schedule" pathology.

What a plain run shows
    torchrun ... --nproc_per_node 2 exits 0 after ~5 s wall, no errors or
    warnings; 80 steps (4 epochs x 20), gate 0.00 for steps 0-11 then ramping
    to 1.00, "done: 80 steps in ~0.6s". An instrumented copy confirmed every
    parameter (hand_branch included, zero grads while the gate is 0) had a
    gradient after every backward on both ranks.
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
class SignConfig:
    frames: int = 32
    body_joints: int = 9
    hand_joints: int = 21
    num_glosses: int = 10
    hidden: int = 64
    num_clips: int = 640
    batch_size: int = 16
    epochs: int = 4
    lr: float = 2e-3
    hand_warmup_steps: int = 12
    hand_ramp_steps: int = 12
    seed: int = 404
    out_dir: str = field(
        default_factory=lambda: os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "sign_language")
    )


class KeypointClips(Dataset):
    """Each gloss = a characteristic wrist trajectory + hand shape (finger spread)."""

    def __init__(self, cfg: SignConfig):
        g = torch.Generator().manual_seed(cfg.seed)
        n, t = cfg.num_clips, cfg.frames
        self.gloss = torch.randint(0, cfg.num_glosses, (n,), generator=g)
        tt = torch.linspace(0, 2 * math.pi, t).view(1, t, 1)
        freq = 1 + (self.gloss % 3).float().view(n, 1, 1)
        phase = (self.gloss.float() / cfg.num_glosses * math.pi).view(n, 1, 1)
        body = 0.05 * torch.randn(n, t, cfg.body_joints * 2, generator=g)
        body[:, :, :2] += torch.cat([torch.sin(freq * tt + phase), torch.cos(freq * tt)], dim=-1) * 0.3
        spread = (0.2 + 0.1 * (self.gloss // 3).float()).view(n, 1, 1)
        fingers = torch.linspace(-1, 1, cfg.hand_joints).view(1, 1, -1)
        hand_x = spread * fingers + 0.03 * torch.randn(n, t, cfg.hand_joints, generator=g)
        hand_y = spread.abs() * fingers ** 2 + 0.03 * torch.randn(n, t, cfg.hand_joints, generator=g)
        hand = torch.cat([hand_x, hand_y], dim=-1)
        self.body, self.hands = body, torch.cat([hand, hand.flip(-1)], dim=-1)  # two hands

    def __len__(self):
        return len(self.gloss)

    def __getitem__(self, idx):
        return self.body[idx], self.hands[idx], self.gloss[idx]


class TemporalEncoder(nn.Module):
    def __init__(self, in_dim, hidden):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(in_dim, hidden, 5, padding=2), nn.GELU(),
            nn.Conv1d(hidden, hidden, 5, padding=2, dilation=1), nn.GELU(),
        )

    def forward(self, x):  # x: (B, T, D)
        return self.net(x.transpose(1, 2)).mean(dim=2)


class GlossRecognizer(nn.Module):
    def __init__(self, cfg: SignConfig):
        super().__init__()
        self.body_branch = TemporalEncoder(cfg.body_joints * 2, cfg.hidden)
        self.hand_branch = TemporalEncoder(cfg.hand_joints * 4, cfg.hidden)
        self.classifier = nn.Sequential(nn.LayerNorm(cfg.hidden), nn.Linear(cfg.hidden, cfg.num_glosses))

    def forward(self, body, hands, hand_gate: float):
        h = self.body_branch(body)
        # always computed; gate 0.0 keeps the branch in the graph during warm-up
        h = h + hand_gate * self.hand_branch(hands)
        return self.classifier(h)


def hand_gate_schedule(step: int, cfg: SignConfig) -> float:
    if step < cfg.hand_warmup_steps:
        return 0.0
    return min(1.0, (step - cfg.hand_warmup_steps + 1) / cfg.hand_ramp_steps)


def main():
    cfg = SignConfig()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)

    dataset = KeypointClips(cfg)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)

    model = DDP(GlossRecognizer(cfg))
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)

    step, t0 = 0, time.time()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        correct = total = 0
        for body, hands, gloss in loader:
            gate = hand_gate_schedule(step, cfg)
            logits = model(body, hands, hand_gate=gate)
            loss = F.cross_entropy(logits, gloss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            correct += (logits.argmax(1) == gloss).sum().item()
            total += gloss.numel()
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step} gate {gate:.2f} loss {loss.item():.3f}", flush=True)
            step += 1
        if rank == 0:
            print(f"epoch {epoch} rank0 train acc {correct / max(1, total):.3f}", flush=True)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "gloss_recognizer.pt"))
        print(f"done: {step} steps in {time.time() - t0:.1f}s", flush=True)
    dist.barrier()  # let rank 0 finish writing before tearing down gloo
    del model, optimizer  # drop DDP (and its handle on the gloo group) before teardown
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
