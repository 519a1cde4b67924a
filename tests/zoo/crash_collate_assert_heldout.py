"""An assertion in the collate function fires on one rank only -> crash on rank 1.

Story: documents are pre-tokenized by an offline job that truncates to MAX_LEN, so the
training code's `pad_collate` just asserts that nothing is longer than MAX_LEN.  A new
data source was appended to the corpus without re-running the truncation step; its one
over-long document (index 243) is dealt by DistributedSampler(shuffle=False) to rank 1,
which reaches it at step 15.  Rank 1 dies with an AssertionError inside the DataLoader's
collate; rank 0 is left waiting in DDP's all-reduce until the launcher tears the job
down.

Root cause: rank 1 (AssertionError in pad_collate, data pipeline).
Right diagnosis: rank 1 crashed with an AssertionError in the collate function; rank 0's
failure/wait is a consequence.
Fix: truncate (or filter out) over-long sequences in the dataset/collate instead of
asserting, or re-run the preprocessing on the new source.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["truncat", "max_len", "filter", "skip", "drop", "too long", "longer than", "preprocess"],
    "names": ["pad_collate"],
    "options": [],
}

MAX_LEN = 64


class PretokenizedCorpus(Dataset):
    def __init__(self, n=640):
        self.docs = []
        for i in range(n):
            g = torch.Generator().manual_seed(i)
            L = int(torch.randint(8, MAX_LEN + 1, (1,), generator=g))
            self.docs.append(torch.randint(1, 1000, (L,), generator=g))
        # appended source "forum-dump-v2" skipped the truncation job
        self.docs[243] = torch.randint(1, 1000, (181,))

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        doc = self.docs[i]
        return doc[:-1], doc[1:]


def pad_collate(batch):
    inputs = torch.zeros(len(batch), MAX_LEN, dtype=torch.long)
    targets = torch.full((len(batch), MAX_LEN), -100, dtype=torch.long)
    for k, (x, y) in enumerate(batch):
        assert x.numel() <= MAX_LEN, f"sequence of length {x.numel()} > MAX_LEN={MAX_LEN}"  # zoo: place
        inputs[k, : x.numel()] = x
        targets[k, : y.numel()] = y
    return inputs, targets


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 32)
        self.mix = nn.Conv1d(32, 32, 3, padding=2)
        self.head = nn.Linear(32, 1000)

    def forward(self, x):
        h = self.emb(x).transpose(1, 2)
        h = torch.relu(self.mix(h)[..., : x.shape[1]]).transpose(1, 2)
        return self.head(h)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ds = PretokenizedCorpus()
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=8, sampler=sampler, collate_fn=pad_collate)
    model = DDP(TinyLM())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step, (x, y) in enumerate(loader):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, 1000), y.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
