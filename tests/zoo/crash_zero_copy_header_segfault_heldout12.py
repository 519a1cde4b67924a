"""Keyword-spotting audio classifier reading packed records (4-byte length header + int16 PCM).
The dataset parses each header zero-copy through ctypes at the tensor's data pointer; a clip
that failed to download was stored as an empty tensor, whose data pointer is NULL. Rank 1's
shard holds that clip, so rank 1 dies with SIGSEGV mid-epoch while rank 0 waits in the all-reduce."""
import ctypes
import struct

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = {
    "kind": "rank_failure",
    "rank": 1,
    "fix": ["segmentation", "sigsegv", "native", "faulthandler", "null"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

N_CLIPS, CLIP_LEN, N_WORDS = 1200, 800, 8
FAILED_DOWNLOADS = {1127}


def pack_clip(pcm):
    return torch.frombuffer(bytearray(struct.pack("<I", pcm.numel()) + pcm.numpy().tobytes()), dtype=torch.uint8)


def build_records():
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, N_WORDS, (N_CLIPS,), generator=g)
    t = torch.arange(CLIP_LEN).float()
    records = []
    for i in range(N_CLIPS):
        if i in FAILED_DOWNLOADS:
            records.append(torch.empty(0, dtype=torch.uint8))  # keep indices aligned with the manifest
            continue
        freq = 0.02 + 0.015 * labels[i].item()
        wave = torch.sin(2 * torch.pi * freq * t) + 0.3 * torch.randn(CLIP_LEN, generator=g)
        records.append(pack_clip((wave * 8000).to(torch.int16)))
    return records, labels


class PackedClips(Dataset):
    def __init__(self, records, labels):
        self.records, self.labels = records, labels

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        rec = self.records[i]
        n = ctypes.c_uint32.from_address(rec.data_ptr()).value  # zoo: place
        pcm = rec[4:4 + 2 * n].view(torch.int16).float() / 32768.0
        return pcm.unsqueeze(0), self.labels[i]


class KWSNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, 16, 9, stride=4), nn.ReLU(),
            nn.Conv1d(16, 32, 9, stride=4), nn.ReLU(),
            nn.AdaptiveAvgPool1d(8),
        )
        self.cls = nn.Linear(32 * 8, N_WORDS)

    def forward(self, x):
        return self.cls(self.features(x).flatten(1))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    records, labels = build_records()
    ds = PackedClips(records, labels)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, drop_last=True)

    model = DDP(KWSNet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
