"""Language-model-style pretraining on pre-tokenized shards: each epoch every rank loads the
next shard, shard_id = (epoch * world + rank) % num_shards. num_shards comes from a glob that
also matches the shard index file, so it counts 4 for 3 shards: in epoch 1 rank 0 loads shard 2
and trains on, while rank 1 asks for shard_00003.pt and dies with FileNotFoundError."""
import glob
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": "rank_failure",
    "rank": 1,
    "fix": ["filenotfounderror", "shard", "file", "exception", "traceback"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

VOCAB, CTX = 256, 32
DATA_DIR = os.path.join(tempfile.gettempdir(), "tok_shards_heldout12")


def write_shards(n_shards=3, seqs_per_shard=640):
    os.makedirs(DATA_DIR, exist_ok=True)
    index = {}
    for s in range(n_shards):
        g = torch.Generator().manual_seed(s)
        # a toy "language": next token = (prev * 7 + 3) % VOCAB with occasional noise
        start = torch.randint(0, VOCAB, (seqs_per_shard, 1), generator=g)
        steps = torch.arange(CTX + 1)
        toks = (start * torch.pow(7, steps % 4) + 3 * steps) % VOCAB
        noise = torch.rand(toks.shape, generator=g) < 0.05
        toks = torch.where(noise, torch.randint(0, VOCAB, toks.shape, generator=g), toks)
        path = os.path.join(DATA_DIR, f"shard_{s:05d}.pt")
        torch.save(toks, path)
        index[path] = int(toks.numel())
    torch.save(index, os.path.join(DATA_DIR, "shard_index.pt"))


def load_shard(shard_id):
    toks = torch.load(os.path.join(DATA_DIR, f"shard_{shard_id:05d}.pt"))  # zoo: place
    return TensorDataset(toks[:, :-1], toks[:, 1:])


class TinyLM(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(CTX, d))
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)
        self.blocks = nn.TransformerEncoder(layer, num_layers=1)
        self.out = nn.Linear(d, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CTX))

    def forward(self, idx):
        h = self.emb(idx) + self.pos
        return self.out(self.blocks(h, mask=self.mask, is_causal=True))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if rank == 0:
        write_shards()
    dist.barrier()
    num_shards = len(glob.glob(os.path.join(DATA_DIR, "shard_*.pt")))

    model = DDP(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for epoch in range(3):
        shard_id = (epoch * world + rank) % num_shards
        ds = load_shard(shard_id)
        loader = DataLoader(ds, batch_size=32, shuffle=True, drop_last=True)
        for _step, (x, y) in enumerate(loader):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        print(f"rank {rank} epoch {epoch} shard {shard_id} loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
