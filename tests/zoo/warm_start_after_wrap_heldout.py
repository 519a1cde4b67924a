"""Warm start done in the wrong order. `build_trainer` wraps the model in DDP first and then, to
avoid every rank reading the same file, lets rank 0 alone load the pretrained encoder
(`Trainer.warm_start`), trusting DDP to share it. DDP broadcasts rank 0's parameters only once,
in its constructor, which has already run: from then on rank 0 trains from the pretrained
encoder and rank 1 from the random one. The gradients are averaged, so the replicas never
re-converge; nothing errors and the job completes, with different weights on each rank.

A right diagnosis: the parameters differ across ranks, root rank 0 (its parameters changed
outside the optimizer step after the DDP constructor's broadcast, at the marked
`load_state_dict` in `Trainer.warm_start`); rank 1 still holds the broadcast weights.
Fix: load the checkpoint before wrapping in DDP (on every rank, or on rank 0 before the
constructor broadcasts), or broadcast the parameters again after loading."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": 0,
    "fix": ["before wrap", "before ddp", "before the ddp", "broadcast", "every rank", "all ranks",
            "sync", "before constructing", "load_state_dict"],
    "options": [],
}

OPTS = {
    "n": 256,
    "dim": 24,
    "hidden": 64,
    "classes": 4,
    "batch_size": 8,
    "lr": 0.01,
    "epochs": 2,
    "seed": 21,
    "pretrained": os.path.join(tempfile.gettempdir(), "zoo_warm_start_encoder.pt"),
}


class Encoder(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)
        self.mix = nn.Linear(hidden, hidden)

    def forward(self, x):
        return torch.relu(self.mix(torch.relu(self.proj(x))))


class Model(nn.Module):
    def __init__(self, o):
        super().__init__()
        self.encoder = Encoder(o["dim"], o["hidden"])
        self.head = nn.Linear(o["hidden"], o["classes"])

    def forward(self, x):
        return self.head(self.encoder(x))


def write_pretrained(o):
    """Stands in for last week's pretraining run."""
    torch.manual_seed(1000 + o["seed"])
    torch.save(Encoder(o["dim"], o["hidden"]).state_dict(), o["pretrained"])


class Trainer:
    def __init__(self, o, model, loader, sampler):
        self.o = o
        self.model = model
        self.loader = loader
        self.sampler = sampler
        self.opt = torch.optim.Adam(model.parameters(), lr=o["lr"])
        self.rank = dist.get_rank()

    def warm_start(self):
        if self.rank != 0:
            return
        if not os.path.exists(self.o["pretrained"]):
            write_pretrained(self.o)
        state = torch.load(self.o["pretrained"], map_location="cpu")
        self.model.module.encoder.load_state_dict(state)  # zoo: place
        os.remove(self.o["pretrained"])

    def fit(self):
        for epoch in range(self.o["epochs"]):
            self.sampler.set_epoch(epoch)
            total = 0.0
            for x, y in self.loader:
                self.opt.zero_grad()
                loss = nn.functional.cross_entropy(self.model(x), y)
                loss.backward()
                self.opt.step()
                total += loss.item()
            if self.rank == 0:
                print(f"epoch {epoch} mean loss {total / len(self.loader):.4f}", flush=True)


def build_trainer(o):
    g = torch.Generator().manual_seed(o["seed"])
    x = torch.randn(o["n"], o["dim"], generator=g)
    y = (x[:, :o["classes"]] + 0.3 * torch.randn(o["n"], o["classes"], generator=g)).argmax(1)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, seed=o["seed"])
    loader = DataLoader(ds, batch_size=o["batch_size"], sampler=sampler)
    torch.manual_seed(o["seed"])
    model = DDP(Model(o))
    trainer = Trainer(o, model, loader, sampler)
    trainer.warm_start()
    return trainer


def main():
    dist.init_process_group("gloo")
    build_trainer(OPTS).fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
