"""One stereo clip in rank 1's shard breaks its collate; rank 0 then dies waiting for it.

Story: a keyword-spotting model trained on 1-second clips.  The clips are cut from field
recordings and stored per recorder; each rank reads the recorders with its parity.  All
recorders are mono except recorder 9 (rank 1), a newer device that writes stereo for one
session: its clips are (2, samples) instead of (samples,).  `random_crop` crops the last
axis, so it works on both, and the collate function `collate_clips` stacks the crops: on
rank 1's batch that holds the stereo clip, `torch.stack` raises "stack expects each tensor to
be equal size".  Rank 1 dies with that traceback; rank 0, already in the gradient all-reduce
of the same step, loses its peer and fails with a gloo connection error a moment later.

Root cause: rank 1 (the RuntimeError in collate_clips, raised by the stereo clip).
Fix: down-mix to mono when loading (`clip.mean(0)` for 2-D clips) or validate the shapes of
the recordings before training; rank 0's error is only the consequence.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)

EXPECT = {
    "kind": ["rank_failure"],
    "rank": 1,
    "fix": ["mono", "stereo", "channel", "mean(", "down-mix", "downmix", "shape", "collate",
            "stack", "exception", "traceback", "RuntimeError"],
    "options": [],
}

RATE = 4000
KEYWORDS = 5


class RecorderClips(Dataset):
    """Clips from one rank's recorders; a clip is a 1.25 s window around a keyword."""

    def __init__(self, recorders, per_recorder=96):
        self.items = []
        for rec in recorders:
            g = torch.Generator().manual_seed(rec)
            for k in range(per_recorder):
                word = int(torch.randint(0, KEYWORDS, (1,), generator=g))
                self.items.append((rec, k, word))

    def __len__(self):
        return len(self.items)

    def load(self, rec, k, word):
        g = torch.Generator().manual_seed(rec * 10_000 + k)
        t = torch.arange(int(1.25 * RATE)) / RATE
        tone = torch.sin(2 * math.pi * (300 + 150 * word) * t) * torch.exp(-3 * (t - 0.6) ** 2)
        clip = tone + 0.3 * torch.randn(len(t), generator=g)
        if rec == 9 and 40 <= k < 48:  # the session recorded in stereo
            clip = torch.stack([clip, clip + 0.05 * torch.randn(len(t), generator=g)])
        return clip

    def __getitem__(self, i):
        rec, k, word = self.items[i]
        return self.load(rec, k, word), word


def random_crop(clip, length=RATE):
    start = int(torch.randint(0, clip.shape[-1] - length + 1, (1,)))
    return clip[..., start:start + length]


def collate_clips(batch):
    crops = [random_crop(clip) for clip, _ in batch]
    labels = torch.tensor([word for _, word in batch])
    return torch.stack(crops), labels  # zoo: place


class KeywordNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.frontend = nn.Conv1d(1, 16, kernel_size=64, stride=16)
        self.body = nn.Sequential(nn.Conv1d(16, 32, 5, stride=2), nn.ReLU(),
                                  nn.Conv1d(32, 32, 5, stride=2), nn.ReLU())
        self.head = nn.Linear(32, KEYWORDS)

    def forward(self, wave):
        h = torch.relu(self.frontend(wave.unsqueeze(1)))
        return self.head(self.body(h).mean(-1))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(KeywordNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    clips = RecorderClips(recorders=range(rank, 12, world))
    loader = DataLoader(clips, batch_size=32, shuffle=True, collate_fn=collate_clips,
                        generator=torch.Generator().manual_seed(rank))
    for epoch in range(3):
        seen, correct = 0, 0
        for wave, label in loader:
            logits = model(wave)
            loss = F.cross_entropy(logits, label)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += len(label)
            correct += (logits.argmax(-1) == label).sum().item()
        if rank == 0:
            print(f"epoch {epoch}: train acc {correct / seen:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
