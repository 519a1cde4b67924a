"""Rank 1 is the job's designated "shadow evaluator": every `eval_every` steps it scores the
current weights on a large held-out set (forward passes of `model.module`, no collectives,
real CPU work, about a quarter of a second) right after its optimizer step. Rank 0 has nothing
to do and goes straight into the next forward/backward, then sits in the gradient all-reduce
(and in the periodic `dist.barrier()` the trainer uses to keep log lines aligned) until rank 1
arrives. Nothing hangs: the job completes, only slower.

A right diagnosis: a straggler / rank-only periodic work on rank 1 (every 4th step, in
`ShadowEvaluator.score`, the marked line), rank 0 waits for it at the gradient sync; not a
hang. Fix: spread the evaluation over all ranks (shard the held-out set), run it less often,
or move it off the training path (async / separate process)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["all ranks", "every rank", "shard", "less often", "async", "evaluat", "spread",
            "background", "separate process", "off the training"],
    "options": [],
}

CONFIG = {
    "train_size": 384,
    "heldout_size": 16000,
    "dim": 32,
    "classes": 5,
    "batch_size": 8,
    "lr": 0.05,
    "eval_every": 4,
    "sync_every": 8,
    "eval_rank": 1,
    "seed": 3,
}


def synthetic(n, dim, classes, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, classes, generator=g)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, (x @ w).argmax(1))


class MLP(nn.Module):
    def __init__(self, dim, classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, classes))

    def forward(self, x):
        return self.net(x)


class ShadowEvaluator:
    """Keeps a running accuracy of the live weights on a held-out set."""

    def __init__(self, heldout, batch):
        self.loader = DataLoader(heldout, batch_size=batch)
        self.history = []

    @torch.no_grad()
    def score(self, net):
        correct = total = 0
        for x, y in self.loader:
            correct += (net(x).argmax(1) == y).sum().item()
            total += len(y)
        self.history.append(correct / total)
        return self.history[-1]


def setup(cfg):
    rank, world = dist.get_rank(), dist.get_world_size()
    train_ds = synthetic(cfg["train_size"], cfg["dim"], cfg["classes"], cfg["seed"])
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, seed=cfg["seed"])
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler)
    torch.manual_seed(cfg["seed"])
    model = DDP(MLP(cfg["dim"], cfg["classes"]))
    evaluator = None
    if rank == cfg["eval_rank"]:
        heldout = synthetic(cfg["heldout_size"], cfg["dim"], cfg["classes"], cfg["seed"] + 1)
        evaluator = ShadowEvaluator(heldout, 4096)
    return rank, sampler, loader, model, evaluator


def main():
    dist.init_process_group("gloo")
    cfg = CONFIG
    rank, sampler, loader, model, evaluator = setup(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            step += 1
            if evaluator is not None and step % cfg["eval_every"] == 0:
                acc = evaluator.score(model.module)  # zoo: place
                if step % (4 * cfg["eval_every"]) == 0:
                    print(f"[rank {rank}] step {step} heldout acc {acc:.3f}", flush=True)
            if step % cfg["sync_every"] == 0:
                dist.barrier()
        if rank == 0:
            print(f"epoch {epoch} done, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
