"""A per-rank length filter leaves the ranks with different numbers of batches (hang).

Sequences are sharded round-robin by rank (`corpus[rank::world]`), then
`SequenceShard` drops sequences shorter than `min_len` -- after sharding.  The
corpus interleaves sources, so rank 1's shard contains many more short
sequences than rank 0's: rank 0 ends up with 18 batches per epoch, rank 1 with
12.  No join() is used.  After its last batch rank 1 goes on to the
end-of-epoch `dist.barrier()` in `end_of_epoch()` (before rank 0 writes a
checkpoint), while rank 0 is still in its 13th backward (DDP gradient
all_reduce), and the job stalls.

Root cause: rank 1 ran out of data first (uneven inputs after the filter).
Right diagnosis: hang from uneven inputs -- rank 1 left the training loop
early / is in a different collective than rank 0 (in backward).
Fix: filter before sharding (or use DistributedSampler on the filtered set
with drop_last), pad to an equal number of batches, or wrap the loop in
model.join().
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["join", "drop_last", "uneven", "pad", "same number", "equal",
            "distributedsampler", "filter"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


def make_corpus(n=1200):
    g = torch.Generator().manual_seed(5)
    corpus = []
    for i in range(n):
        # two sources interleaved: even ids are long documents, odd ids are mostly short
        hi = 64 if i % 2 == 0 else 32
        length = int(torch.randint(8, hi, (1,), generator=g))
        corpus.append(torch.randint(0, 100, (length,), generator=g))
    return corpus


class SequenceShard(Dataset):
    def __init__(self, corpus, rank, world, min_len=20, ctx=16):
        shard = corpus[rank::world]
        self.seqs = [s[:ctx + 1] for s in shard if len(s) >= min_len]

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        return s[:-1], s[1:]


class TinyLM(nn.Module):
    def __init__(self, vocab=100, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        return self.out(h)


def end_of_epoch(model, epoch, total, count, rank):
    dist.barrier()          # everyone done with the epoch before the checkpoint
    if rank == 0:
        torch.save(model.module.state_dict(), f"/tmp/tinylm_rank0_e{epoch}.pt")
        print(f"epoch {epoch} loss {total / max(count, 1):.4f}", flush=True)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = SequenceShard(make_corpus(), rank, world)
    loader = DataLoader(ds, batch_size=24, shuffle=True, drop_last=True)
    print(f"rank {rank}: {len(ds)} sequences, {len(loader)} batches", flush=True)
    torch.manual_seed(0)
    model = DDP(TinyLM())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(2):
        total, count = 0.0, 0
        for x, y in loader:
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            count += 1
        end_of_epoch(model, epoch, total, count, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
