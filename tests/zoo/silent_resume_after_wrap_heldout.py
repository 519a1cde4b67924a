"""Checkpoint restored on rank 0 only, after the model was wrapped in DDP -> silent divergence.

Story: a `Trainer` builds the model, wraps it in DDP in `__init__`, and afterwards
`Trainer.resume()` restores the last checkpoint.  To "avoid every rank hitting the shared
filesystem" the author loads the checkpoint only on rank 0, assuming DDP will broadcast
rank 0's weights.  DDP only broadcasts parameters once, at construction, so rank 0 now
continues from the checkpoint while rank 1 continues from its random initialisation.
Gradients are still averaged and every collective matches, so training runs and exits 0,
but the two replicas never agree again (see the per-rank checksums printed at the end).

Root cause: rank 0 (its weights were changed after DDP construction, without a broadcast).
Right diagnosis: model parameters differ across ranks (silent divergence) starting at the
first step; the replicas were never in sync after the checkpoint load on rank 0.
Fix: load the checkpoint on every rank (or load before wrapping the model in DDP, or
broadcast the parameters from rank 0 after loading).
"""

import io

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": None,
    "rank": 0,
    "fix": [
        "every rank",
        "all ranks",
        "each rank",
        "before wrapping",
        "before ddp",
        "before constructing",
        "before creating",
        "broadcast",
        "sync_module_states",
    ],
    "options": [],
}


def build_model():
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 10)
    )


def fake_checkpoint_store():
    """Stand-in for the checkpoint written by the previous job."""
    torch.manual_seed(1234)
    prev = build_model()
    buf = io.BytesIO()
    torch.save({"model": prev.state_dict(), "step": 500}, buf)
    return buf.getvalue()


class Trainer:
    def __init__(self, rank, ckpt_bytes):
        self.rank = rank
        self.ckpt_bytes = ckpt_bytes
        torch.manual_seed(rank)  # per-rank seed for augmentation / dropout
        self.model = DDP(build_model())
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.start_step = 0

    def resume(self):
        if self.rank == 0:  # only one reader on the shared filesystem
            state = torch.load(io.BytesIO(self.ckpt_bytes))
            self.model.module.load_state_dict(state["model"])
            self.start_step = state["step"]
        obj = [self.start_step]
        dist.broadcast_object_list(obj, src=0)
        self.start_step = obj[0]

    def train(self, steps):
        g = torch.Generator().manual_seed(100 + self.rank)
        for step in range(self.start_step, self.start_step + steps):
            x = torch.randn(16, 1, 12, 12, generator=g)
            y = torch.randint(0, 10, (16,), generator=g)
            loss = F.cross_entropy(self.model(x), y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            if self.rank == 0 and step % 20 == 0:
                print(f"step {step} loss {loss.item():.3f}", flush=True)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer = Trainer(rank, fake_checkpoint_store())
    trainer.resume()
    trainer.train(60)
    cs = sum(p.detach().double().sum().item() for p in trainer.model.module.parameters())
    print(f"rank {rank} weight checksum {cs:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
