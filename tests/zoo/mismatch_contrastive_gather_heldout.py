"""Caption filtering in the collate function shrinks one rank's batch; the contrastive loss
all-gathers embeddings of different sizes (collective mismatch, rank 1 aborts).

Story: a small CLIP-style model aligns precomputed image features with product captions.  The
contrastive loss uses the negatives of every rank: `gather_embeddings` all-gathers the image
and text embeddings into buffers shaped like the *local* batch (`torch.zeros_like(z)`, the
usual OpenCLIP pattern).  `collate_pairs` tokenizes captions, strips stop words and silently
drops pairs whose caption becomes empty ("a photo of the", "an image of a") so the text
encoder never sees an empty bag.  At step 8 rank 1's batch loses one such pair (31 rows)
while rank 0's has 32: the all_gather exchanges tensors of different sizes.  Gloo's receiver
on rank 1 gets more bytes than it expects and aborts the process (SIGABRT, "op.preamble.length
<= op.nbytes ... Is there a distributed collective mismatch in your code?"); rank 0 then
fails in its next collective (connection closed) or is terminated.

Root cause: rank 1's batch is smaller than the others' because `collate_pairs` drops pairs,
and `gather_embeddings` assumes every rank has the same batch size.
Right diagnosis: collective size mismatch in all_gather (gather_embeddings, from the loss)
at the same sequence number: rank 1 contributed 31 rows, rank 0 32; rank 1 aborted.
Fix: keep the batch size fixed on every rank (filter empty captions when building the
dataset, or replace them instead of dropping), or gather variable sizes properly (all-gather
the sizes first and pad to the maximum, or all_gather_object).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["pad", "same size", "same shape", "same batch", "fixed batch", "variable",
            "all_gather_object", "sizes", "drop", "filter", "empty caption"],
    "names": [["gather_embeddings", "all_gather"]],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

STOP = {"a", "an", "the", "of", "photo", "image", "picture"}
WORDS = ["red", "blue", "green", "black", "white", "leather", "cotton", "steel", "wooden",
         "shoe", "bag", "chair", "lamp", "mug", "shirt", "watch", "table", "jacket"]
VOCAB = {w: i + 1 for i, w in enumerate(WORDS)}  # 0 = padding
EMPTY_AT = (1391, 1617, 1913, 2050, 2871, 2939)  # captions that are only stop words
SAMPLER_SEED = 3


class ProductPairs(Dataset):
    def __init__(self, n=3072, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.attr = torch.randint(0, 9, (n,), generator=g)
        self.obj = torch.randint(9, len(WORDS), (n,), generator=g)
        proto = torch.randn(len(WORDS), 96, generator=g)
        self.img = proto[self.attr] + proto[self.obj] + 0.5 * torch.randn(n, 96, generator=g)

    def __len__(self):
        return len(self.attr)

    def __getitem__(self, i):
        if i in EMPTY_AT:
            caption = "a photo of the" if i % 2 else "an image of a"
        else:
            caption = f"a photo of a {WORDS[self.attr[i]]} {WORDS[self.obj[i]]}"
        return self.img[i], caption


def collate_pairs(batch):
    imgs, toks = [], []
    for img, caption in batch:
        ids = [VOCAB[w] for w in caption.split() if w not in STOP]
        if not ids:  # nothing left to encode: skip the pair
            continue
        imgs.append(img)
        toks.append(torch.tensor(ids))
    return torch.stack(imgs), nn.utils.rnn.pad_sequence(toks, batch_first=True)


class DualEncoder(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.img_proj = nn.Sequential(nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, dim))
        self.tok = nn.EmbeddingBag(len(WORDS) + 1, dim, mode="mean", padding_idx=0)
        self.txt_proj = nn.Linear(dim, dim)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, img, tokens):
        zi = F.normalize(self.img_proj(img), dim=1)
        zt = F.normalize(self.txt_proj(self.tok(tokens)), dim=1)
        return zi, zt, self.logit_scale.exp()


def gather_embeddings(z):
    out = [torch.zeros_like(z) for _ in range(dist.get_world_size())]
    dist.all_gather(out, z.detach())  # zoo: place
    out[dist.get_rank()] = z  # keep the local rows differentiable
    return torch.cat(out)


def clip_loss(zi, zt, scale):
    rank = dist.get_rank()
    all_i, all_t = gather_embeddings(zi), gather_embeddings(zt)  # zoo: place
    labels = torch.arange(len(zi)) + rank * len(zi)
    return 0.5 * (F.cross_entropy(scale * zi @ all_t.T, labels) +
                  F.cross_entropy(scale * zt @ all_i.T, labels))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = ProductPairs()
    sampler = DistributedSampler(ds, world, rank, shuffle=True, seed=SAMPLER_SEED)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, collate_fn=collate_pairs)
    torch.manual_seed(0)
    model = DDP(DualEncoder())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for _step, (img, tokens) in enumerate(loader):
            loss = clip_loss(*model(img, tokens))
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
