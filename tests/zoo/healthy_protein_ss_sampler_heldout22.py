"""Protein secondary-structure prediction (helix / strand / coil) per residue.

A dilated 1-D CNN labels each residue of synthetic protein fragments (one-hot amino acids;
helix-forming and strand-forming residues are enriched in the respective segments). The
dataset is shared by both ranks and split with DistributedSampler(shuffle=True,
drop_last=True); `sampler.set_epoch(epoch)` is called at the start of every epoch, so each
epoch sees a fresh permutation, and the per-epoch metrics are averaged with one fixed-size
all_reduce that every rank issues. The rank-0 print of the first indices of each epoch shows
the order changing between epochs.

Root cause: none (healthy job).
Fix: nothing to fix.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = None

AA = "ACDEFGHIKLMNPQRSTVWY"
HELIX_FORMERS = "AELMQKR"
STRAND_FORMERS = "VIYFWT"
L = 48


class Fragments(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = [], []
        helix_ids = torch.tensor([AA.index(a) for a in HELIX_FORMERS])
        strand_ids = torch.tensor([AA.index(a) for a in STRAND_FORMERS])
        for _ in range(n):
            labels = torch.zeros(L, dtype=torch.long)
            pos = 0
            while pos < L:
                seg = int(torch.randint(4, 12, (1,), generator=g))
                labels[pos : pos + seg] = int(torch.randint(0, 3, (1,), generator=g))
                pos += seg
            seq = torch.randint(0, len(AA), (L,), generator=g)
            enrich = torch.rand(L, generator=g) < 0.6
            hpick = helix_ids[torch.randint(0, len(helix_ids), (L,), generator=g)]
            spick = strand_ids[torch.randint(0, len(strand_ids), (L,), generator=g)]
            seq = torch.where(enrich & (labels == 0), hpick, seq)
            seq = torch.where(enrich & (labels == 1), spick, seq)
            self.x.append(F.one_hot(seq, len(AA)).float().T)
            self.y.append(labels)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class SSNet(nn.Module):
    def __init__(self):
        super().__init__()
        layers, ch = [], len(AA)
        for d in (1, 2, 4):
            layers += [nn.Conv1d(ch, 32, 3, padding=d, dilation=d), nn.ReLU()]
            ch = 32
        self.body = nn.Sequential(*layers)
        self.out = nn.Conv1d(32, 3, 1)

    def forward(self, x):
        return self.out(self.body(x))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = Fragments(900, seed=5)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=17, drop_last=True)
    loader = DataLoader(ds, batch_size=24, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(SSNet())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        stats = torch.zeros(3)  # loss sum, correct residues, residues
        first = None
        for x, y, idx in loader:
            if first is None:
                first = idx[:5].tolist()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            stats += torch.tensor([loss.item() * y.numel(), (logits.argmax(1) == y).sum().item(), y.numel()])
        dist.all_reduce(stats)
        if rank == 0:
            print(
                f"epoch {epoch}: first indices {first} loss {stats[0] / stats[2]:.3f} "
                f"Q3 {stats[1] / stats[2]:.3f}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
