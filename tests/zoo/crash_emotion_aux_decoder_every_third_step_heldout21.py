"""Speech-emotion model: a decoder run every 3rd step leaves DDP waiting for its gradients.

Story: a speech-emotion recogniser on log-mel frames (40 mels x 64 frames).  Besides the
emotion head, the model has a frame-reconstruction decoder used as a regulariser (reconstruct
the mel frames from the encoder's features).  The decoder is the expensive part of the step,
so the training loop asks for it only on every 3rd step (`with_recon=step % 3 == 0`).  The
DDP wrapper is built with the default `find_unused_parameters=False`.  Step 0 uses the
decoder; on step 1 the decoder's parameters get no gradient, DDP's reducer never finishes
that iteration's reduction, and the forward of step 2 raises "Expected to have finished
reduction in the prior iteration before starting a new one" on both ranks.

Root cause: no single rank (both skip the decoder on the same steps): parameters unused in
some iterations under find_unused_parameters=False.
Fix: build DDP with `find_unused_parameters=True`, or make every step's loss touch the
decoder (e.g. add `0 * recon.sum()`), or run the regulariser every step.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["unused_parameters"],
    "rank": None,
    "fix": ["find_unused_parameters", "unused", "every step", "every iteration", "0 *",
            "* 0", "zero", "static_graph"],
    "options": [],
    "names": [["decoder", "recon"]],
}

EMOTIONS = 6
MELS, FRAMES = 40, 64
RECON_EVERY = 3


def utterances(rank, n=256):
    g = torch.Generator().manual_seed(70 + rank)
    label = torch.randint(0, EMOTIONS, (n,), generator=g)
    pitch = (label.float() / EMOTIONS)[:, None, None]
    mel = torch.randn(n, MELS, FRAMES, generator=g) * 0.5
    mel += torch.linspace(0, 1, MELS)[None, :, None] * pitch
    return TensorDataset(mel, label)


class EmotionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv1d(MELS, 64, 5, padding=2), nn.ReLU(),
                                     nn.Conv1d(64, 64, 5, padding=2), nn.ReLU())
        self.head = nn.Linear(64, EMOTIONS)
        self.decoder = nn.Sequential(nn.Conv1d(64, 64, 5, padding=2), nn.ReLU(),
                                     nn.Conv1d(64, MELS, 5, padding=2))

    def forward(self, mel, with_recon=False):
        h = self.encoder(mel)
        logits = self.head(h.mean(-1))
        recon = self.decoder(h) if with_recon else None
        return logits, recon


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(EmotionNet())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    loader = DataLoader(utterances(rank), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))
    step = 0
    for epoch in range(3):
        for mel, label in loader:
            logits, recon = model(mel, with_recon=step % RECON_EVERY == 0)
            loss = F.cross_entropy(logits, label)
            if recon is not None:
                loss = loss + 0.5 * F.mse_loss(recon, mel)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        print(f"rank {rank} epoch {epoch}: loss {loss.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
