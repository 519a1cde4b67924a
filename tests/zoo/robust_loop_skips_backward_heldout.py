"""A "robust" trainer: `Trainer.run_epoch` wraps each step in try/except so that a bad batch is
logged and skipped instead of killing the job. The loss (`masked_nll`) validates its targets
and raises ValueError on an unlabeled record (target -1); the one such record falls in rank 0's
shard. Rank 0 has already run the DDP forward for that batch, swallows the exception and
`continue`s without a backward, so it runs one gradient all-reduce fewer than rank 1. From then
on rank 0 is a step ahead; when it finishes its loader it enters the `dist.barrier()` in
`Trainer.summarize` while rank 1 still waits in the gradient all-reduce of its last step: the job hangs.

A right diagnosis: root rank 0, which skipped a backward (a forward without backward / one step
fewer) at the swallowed exception in `Trainer.run_epoch` (the marked `continue`); rank 1's wait
in the gradient all-reduce is the consequence. Fix: do not skip the backward on one rank only:
filter bad records in the dataset / on every rank, or run a zero-loss backward (loss * 0) so
every rank joins the all-reduce; re-raise instead of swallowing."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None,
    "rank": 0,
    "fix": ["every rank", "all ranks", "skip", "swallow", "re-raise", "raise", "zero loss",
            "loss * 0", "backward", "filter", "except"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

SETTINGS = dict(samples=160, in_dim=20, n_cls=6, batch=8, lr=1e-2, seed=11, log_every=5)


def make_dataset(s):
    g = torch.Generator().manual_seed(s["seed"])
    feats = torch.randn(s["samples"], s["in_dim"], generator=g)
    labels = torch.randint(0, s["n_cls"], (s["samples"],), generator=g)
    labels[42] = -1  # a record nobody labelled (even index: rank 0's shard)
    return TensorDataset(feats, labels)


def masked_nll(logits, target, n_cls):
    if (target < 0).any() or (target >= n_cls).any():
        raise ValueError(f"target out of range: {target.tolist()}")
    return F.nll_loss(F.log_softmax(logits, dim=-1), target)


class Net(nn.Module):
    def __init__(self, d, k):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.classifier = nn.Linear(64, k)

    def forward(self, x):
        return self.classifier(self.encoder(x))


class Trainer:
    def __init__(self, s):
        self.s = s
        self.rank = dist.get_rank()
        self.ds = make_dataset(s)
        self.sampler = DistributedSampler(self.ds, shuffle=False)
        self.loader = DataLoader(self.ds, batch_size=s["batch"], sampler=self.sampler)
        torch.manual_seed(s["seed"])
        self.model = DDP(Net(s["in_dim"], s["n_cls"]))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=s["lr"])
        self.loss_sum = 0.0
        self.skipped = 0
        self.steps = 0

    def run_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(self.loader):
            self.opt.zero_grad()
            try:
                logits = self.model(x)
                loss = masked_nll(logits, y, self.s["n_cls"])
            except ValueError as exc:
                self.skipped += 1
                print(f"[rank {self.rank}] skipping batch {i}: {exc}", flush=True)
                continue  # zoo: place
            loss.backward()
            self.opt.step()
            self.loss_sum += loss.item()
            self.steps += 1
            if self.rank == 0 and i % self.s["log_every"] == 0:
                print(f"epoch {epoch} batch {i} loss {loss.item():.4f}", flush=True)

    def summarize(self):
        dist.barrier()  # let every rank finish its epoch before the totals
        totals = torch.tensor([self.loss_sum, float(self.steps), float(self.skipped)])
        dist.all_reduce(totals)
        if self.rank == 0:
            print(f"mean loss {totals[0] / max(totals[1], 1):.4f}, skipped {int(totals[2])}", flush=True)


def main():
    dist.init_process_group("gloo")
    trainer = Trainer(SETTINGS)
    trainer.run_epoch(0)
    trainer.summarize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
