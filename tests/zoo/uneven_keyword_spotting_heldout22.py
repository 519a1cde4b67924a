"""Keyword spotting ("yes"/"no"/"stop"/"go") on synthetic log-mel utterances.

Utterances are synthesised per keyword as formant-like tracks over 40 mel bins. The manifest
is split round-robin across ranks, and each rank then drops utterances longer than the
model's receptive budget (MAX_FRAMES) itself. The manifest is ordered by recording session,
and even-numbered sessions come from a slower-speaking cohort, so the filter removes many more utterances from rank 0's
stride than from rank 1's. Training runs 2 epochs with a barrier at the end of each epoch
(before rank 0 logs the epoch summary).

Root cause: filtering by duration *after* the round-robin shard leaves rank 1 with more
batches per epoch than rank 0; at the end of epoch 0 rank 0 waits in the epoch barrier while
rank 1 runs its extra batch's gradient all-reduce, and neither can proceed.
Fix: filter the manifest before sharding (or use DistributedSampler over the filtered set),
pad/truncate so every rank gets the same number of batches, or wrap the loop in
torch.distributed.algorithms.Join (model.join()).

The root rank is the one that ran out of batches first (rank 0), as for every uneven-inputs
case of the zoo; the set's author named rank 1, whose shard is the larger (neither rank's code
differs: the split does). Scored with the author's rank, held-out set 22 counts this case wrong.
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

EXPECT = {
    "kind": ["uneven_inputs", "hang"],
    "rank": 0,
    "fix": [
        "join",
        "distributedsampler",
        "drop_last",
        "pad",
        "equal",
        "even",
        "same number",
        "before shard",
        "filter",
        "truncate",
        "uneven",
        "shard",
        "balance",
    ],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

KEYWORDS = ["yes", "no", "stop", "go"]
N_MELS = 40
MAX_FRAMES = 48


def synth_manifest(n, seed):
    g = torch.Generator().manual_seed(seed)
    items = []
    for k in range(n):
        label = int(torch.randint(0, len(KEYWORDS), (1,), generator=g))
        slow_speaker = float(torch.rand(1, generator=g)) < (0.22 if k % 2 == 0 else 0.04)
        frames = (
            int(torch.randint(52, 64, (1,), generator=g))
            if slow_speaker
            else int(torch.randint(24, 47, (1,), generator=g))
        )
        items.append(
            {
                "id": f"utt{k:05d}",
                "label": label,
                "frames": frames,
                "seed": int(torch.randint(0, 2**31 - 1, (1,), generator=g)),
            }
        )
    return items


def render(item):
    g = torch.Generator().manual_seed(item["seed"])
    t = torch.linspace(0, 1, item["frames"])
    mel = torch.arange(N_MELS).float()
    f1 = 8 + 6 * item["label"] + 4 * torch.sin(3.1 * t * (item["label"] + 1))
    spec = torch.exp(-((mel[None, :] - f1[:, None]) ** 2) / 8.0)
    spec += 0.1 * torch.rand(item["frames"], N_MELS, generator=g)
    out = torch.zeros(MAX_FRAMES, N_MELS)
    out[: item["frames"]] = spec
    return out


class Utterances(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        return render(it), it["label"]


def shard_manifest(items, rank, world):
    mine = items[rank::world]
    mine = [it for it in mine if it["frames"] <= MAX_FRAMES]  # zoo: place
    return mine


class KWS(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(N_MELS, 32, 5, padding=2), nn.ReLU(), nn.Conv1d(32, 32, 5, padding=2), nn.ReLU()
        )
        self.fc = nn.Linear(32, len(KEYWORDS))

    def forward(self, x):  # x: [B, T, M]
        return self.fc(self.conv(x.transpose(1, 2)).mean(-1))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = synth_manifest(640, seed=3)
    shard = shard_manifest(manifest, rank, world)
    loader = DataLoader(
        Utterances(shard), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(rank)
    )
    print(f"rank {rank}: {len(shard)} utterances, {len(loader)} batches/epoch", flush=True)
    torch.manual_seed(0)
    model = DDP(KWS())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    t0 = time.time()
    for epoch in range(2):
        total, n = 0.0, 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, n = total + loss.item(), n + 1
        print(
            f"rank {rank} epoch {epoch} done {n} steps, waiting at epoch barrier t={time.time() - t0:.1f}s",
            flush=True,
        )
        dist.barrier()
        if rank == 0:
            print(f"epoch {epoch} mean loss {total / n:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
