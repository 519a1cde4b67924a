"""Healthy twin of warm_start_after_wrap.py: rank 0 loads the pretrained encoder into the bare
model *before* it is wrapped in DDP, so the DDP constructor's broadcast hands rank 0's
(pretrained) parameters to rank 1 and both replicas start, and stay, identical. The job
completes. Nothing is wrong: no warning or error should be reported."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

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


def warm_start(model, o):
    if dist.get_rank() != 0:
        return
    if not os.path.exists(o["pretrained"]):
        write_pretrained(o)
    state = torch.load(o["pretrained"], map_location="cpu")
    model.encoder.load_state_dict(state)
    os.remove(o["pretrained"])


class Trainer:
    def __init__(self, o, model, loader, sampler):
        self.o = o
        self.model = model
        self.loader = loader
        self.sampler = sampler
        self.opt = torch.optim.Adam(model.parameters(), lr=o["lr"])
        self.rank = dist.get_rank()

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
    net = Model(o)
    warm_start(net, o)
    model = DDP(net)
    return Trainer(o, model, loader, sampler)


def main():
    dist.init_process_group("gloo")
    build_trainer(OPTS).fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
