"""Short clips skip the context encoder: unused parameters with find_unused_parameters=False
(crash on rank 1).

Story: a keyword-spotting model on MFCC frames.  To save compute, clips are batched by length
bucket (`LengthBucketSampler`: every batch holds clips of one bucket, batches dealt to the
ranks round-robin), and `KWSNet.forward` skips the convolutional context encoder for short
buckets ("a 0.3 s clip has no context to model").  The model is wrapped with the default
`find_unused_parameters=False`.  The first short batch lands on rank 1 at step 3: its
backward never produces gradients for `context.*`, so DDP's reducer on rank 1 never marks
that bucket ready and does not launch its all-reduce; rank 0 (long clips, all parameters
used) waits in the all-reduce.  At the next forward rank 1 raises "RuntimeError: Expected to
have finished reduction in the prior iteration before starting a new one ... Parameter
indices which did not receive grad for rank 1: 2 3 4 5" (indices 2-5 are context.0.weight,
context.0.bias, context.2.weight, context.2.bias); rank 0 then fails with a gloo connection
error.

Root cause: rank 1, data-dependent branch in KWSNet.forward leaves `context` unused while DDP
was built with find_unused_parameters=False.
Right diagnosis: rank 1 failed first with the DDP "Expected to have finished reduction"
error naming the context.* parameters (unused in the previous iteration because of the
short-clip branch); rank 0's error is a consequence.
Fix: `DDP(..., find_unused_parameters=True)`, or always run the context encoder (e.g. multiply
its output by 0 for short clips) so every parameter gets a gradient each step.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["find_unused_parameters", "unused"],
    "names": ["context"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

N_MFCC, N_WORDS = 20, 10
BUCKETS = (24, 64, 96)  # frames
SEED = 20


class ClipDataset(Dataset):
    def __init__(self, n=960, seed=7):
        g = torch.Generator().manual_seed(seed)
        self.words = torch.randint(0, N_WORDS, (n,), generator=g)
        self.lengths = torch.tensor(BUCKETS)[torch.multinomial(
            torch.tensor([0.15, 0.5, 0.35]), n, replacement=True, generator=g)]
        self.protos = torch.randn(N_WORDS, N_MFCC, generator=g)
        self.seed = seed

    def __len__(self):
        return len(self.words)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        t = int(self.lengths[i])
        x = self.protos[self.words[i]].unsqueeze(0) + torch.randn(t, N_MFCC, generator=g)
        return x, self.words[i]


class LengthBucketSampler(Sampler):
    """Batches of same-length clips, shuffled, dealt to ranks round-robin."""

    def __init__(self, lengths, batch_size, rank, world, seed=0):
        self.lengths, self.bs, self.rank, self.world, self.seed = lengths, batch_size, rank, world, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        batches = []
        for b in BUCKETS:
            idx = torch.nonzero(self.lengths == b).squeeze(1)
            idx = idx[torch.randperm(len(idx), generator=g)].tolist()
            batches += [idx[i:i + self.bs] for i in range(0, len(idx) - self.bs + 1, self.bs)]
        order = torch.randperm(len(batches), generator=g).tolist()
        batches = [batches[i] for i in order]
        n = len(batches) // self.world * self.world
        return batches[:n][self.rank::self.world]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class KWSNet(nn.Module):
    def __init__(self, short_clip=32):
        super().__init__()
        self.short_clip = short_clip
        self.frontend = nn.Sequential(nn.Conv1d(N_MFCC, 48, 3, padding=1), nn.ReLU())
        self.context = nn.Sequential(nn.Conv1d(48, 48, 5, padding=4, dilation=2), nn.ReLU(),
                                     nn.Conv1d(48, 48, 5, padding=8, dilation=4))
        self.classifier = nn.Linear(48, N_WORDS)

    def forward(self, x):  # x: (B, T, n_mfcc)
        h = self.frontend(x.transpose(1, 2))
        if x.size(1) > self.short_clip:  # short clips carry no context worth modelling  # zoo: place
            h = h + self.context(h)
        return self.classifier(h.mean(2))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = ClipDataset()
    sampler = LengthBucketSampler(ds.lengths, 16, rank, world, seed=SEED)
    loader = DataLoader(ds, batch_sampler=sampler)
    torch.manual_seed(0)
    model = DDP(KWSNet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for _step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)  # zoo: place
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
