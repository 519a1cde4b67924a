"""Music-genre classifier with resume support: set_epoch is called once, before the epoch loop.

Story: a genre classifier trained on pre-computed 64-d audio embeddings of 30-second
previews.  The data is sharded with a DistributedSampler(shuffle=True).  When the team added
resume-from-checkpoint, they wrote `train_sampler.set_epoch(start_epoch)` "so a resumed run
continues with the shuffle of the epoch it stopped in", and placed it right after loading the
checkpoint, above `for epoch in range(start_epoch, EPOCHS)`.  On a fresh run that sets epoch
0 once; the sampler's seed never changes again, so each of the six epochs deals every rank
exactly the same previews in exactly the same order.  Nothing fails; the model just sees one
fixed ordering (and the same batch compositions) over and over, which hurts generalisation.

Root cause: the `set_epoch` call placed before the loop instead of inside it (every rank).
Fix: call `train_sampler.set_epoch(epoch)` at the start of every epoch, inside the loop.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)

EXPECT = {
    "kind": ["missing_set_epoch"],
    "rank": None,
    "fix": ["set_epoch", "every epoch", "each epoch", "inside the loop", "per epoch"],
    "options": [],
}

GENRES = 8
EPOCHS = 6
CKPT_DIR = os.path.join(tempfile.gettempdir(), "genre_ckpt_ho21")


def previews(n=2048):
    g = torch.Generator().manual_seed(31)
    centers = torch.randn(GENRES, 64, generator=g)
    genre = torch.randint(0, GENRES, (n,), generator=g)
    emb = centers[genre] * 0.6 + torch.randn(n, 64, generator=g)
    return TensorDataset(emb, genre)


class GenreHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.2),
                                 nn.Linear(128, GENRES))

    def forward(self, x):
        return self.net(x)


def resume(model, opt, path):
    if not path:
        return 0
    state = torch.load(path, map_location="cpu")
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return state["epoch"] + 1


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(GenreHead())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)

    data = previews()
    train_sampler = DistributedSampler(data, shuffle=True, seed=17)
    loader = DataLoader(data, batch_size=32, sampler=train_sampler)

    path = os.path.join(CKPT_DIR, "last.pt")
    start_epoch = resume(model, opt, os.environ.get("GENRE_RESUME"))  # unset on a fresh run
    train_sampler.set_epoch(start_epoch)  # zoo: place
    for epoch in range(start_epoch, EPOCHS):
        first = list(iter(train_sampler))[:5]
        correct, seen = 0, 0
        for x, y in loader:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct += (logits.argmax(-1) == y).sum().item()
            seen += len(y)
        print(f"rank {rank} epoch {epoch}: acc {correct / seen:.3f}, first samples {first}",
              flush=True)
        if rank == 0:
            os.makedirs(CKPT_DIR, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, path + ".tmp")
            os.replace(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
