"""Patient-level split gives the ranks different numbers of batches (uneven inputs, hang).

Story: a lung-nodule classifier on CT patches.  To avoid leaking one patient's scans into two
ranks' batches (and to keep the per-patient metrics simple) the author shards by patient:
`PATIENTS[rank::world]` -- each rank loads every patch of its patients.  Patients have very
different numbers of patches, so rank 0 ends up with 118 patches (8 batches of 16) and rank 1
with 157 (10 batches).  Nothing pads or balances the shards and there is no
`model.join()`.  At the end of epoch 0 rank 0 runs out of batches and goes to the
`dist.barrier()` that guards the rank-0 checkpoint, while rank 1 still trains its 9th batch
and waits in the DDP gradient all-reduce that rank 0 will never join.  The job hangs.

Root cause: uneven inputs -- the per-rank datasets (`patient_shard`) have different lengths,
so the ranks run a different number of training steps per epoch.
Right diagnosis: hang at the end of epoch 0; rank 0 finished its 8 steps and waits in
barrier, rank 1 is at step 9 in the backward all-reduce; the ranks' step counts differ
(8 vs 10 batches per epoch).
Fix: give every rank the same number of batches (balance the patient split by patch count,
pad / repeat, or cap each rank at the minimum count agreed with an all-reduce), or wrap the
loop in `model.join()` (torch.distributed.algorithms.Join).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": ["join", "uneven", "same number", "equal", "balance", "pad", "min", "drop_last",
            "distributedsampler"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

# patient id -> number of 16x16x16 patches extracted around candidate nodules
PATIENTS = {"LIDC-0003": 31, "LIDC-0011": 44, "LIDC-0017": 25, "LIDC-0024": 38,
            "LIDC-0031": 40, "LIDC-0042": 52, "LIDC-0056": 22, "LIDC-0063": 23}


def load_patient(pid, n):
    g = torch.Generator().manual_seed(int(pid[-4:]))
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 1, 16, 16, 16, generator=g) + y.view(-1, 1, 1, 1, 1) * 0.7
    return TensorDataset(x, y)


def patient_shard(rank, world):
    ids = sorted(PATIENTS)[rank::world]  # zoo: place
    return ConcatDataset([load_patient(p, PATIENTS[p]) for p in ids])


class NoduleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4 * 4, 2)

    def forward(self, x):
        return self.fc(F.max_pool3d(F.relu(self.conv(x)), 4).flatten(1))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = patient_shard(rank, world)
    loader = DataLoader(ds, batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))
    print(f"rank {rank}: {len(ds)} patches, {len(loader)} batches per epoch", flush=True)
    torch.manual_seed(0)
    model = DDP(NoduleNet())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = os.path.join(tempfile.gettempdir(), f"nodule-{os.environ['MASTER_PORT']}.pt")
    for epoch in range(3):
        for step, (x, y) in enumerate(loader):  # noqa: B007
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()  # zoo: place
            opt.step()
        print(f"rank {rank} epoch {epoch} done after {step + 1} steps", flush=True)
        dist.barrier()  # everyone finished the epoch before the checkpoint is written
        if rank == 0:
            torch.save(model.module.state_dict(), ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
