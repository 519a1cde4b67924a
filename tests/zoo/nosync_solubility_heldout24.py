"""Aqueous solubility (logS) regression from molecular fingerprints, trained with DDP.

Story
-----
Molecules are represented by 2048-bit circular fingerprints plus a handful of RDKit-style
descriptors (MolWt, logP, TPSA, H-bond donors/acceptors, rotatable bonds).  An MLP regresses
logS.  The effective batch size is kept at 256 on small machines with gradient accumulation:
micro-batches of 32, ACCUM_STEPS = 4, and `model.no_sync()` on the micro-steps that are not an
optimizer step, so that DDP only all-reduces once per optimizer step.

Root cause
----------
`is_accumulation_boundary()` returns `micro_step % accum_steps == accum_steps`, which is never
true (the remainder is always < accum_steps); the intended test is
`(micro_step + 1) % accum_steps == 0`.  Every backward pass therefore runs inside
`model.no_sync()`, DDP never all-reduces a single gradient, and each rank applies its own local
gradients in `opt.step()` (which is driven by a separate, correct counter).  No error and no
hang: the two replicas simply train independently on their shards and their weights drift
apart.
Fix: make the accumulation-boundary test `(micro_step + 1) % accum_steps == 0`, so that the last
micro-batch of every accumulation window runs outside `no_sync()` and gradients are synced.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): exit code 0 in ~6-7 s, no
warning or error, val RMSE falls 1.72 -> 1.16; final parameter checksums differ: rank 0
441.0702325841 vs rank 1 434.4262156862.
"""
import contextlib
import logging
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": ["gradients_not_synced", "weights_diverged"],
    "rank": None,
    "fix": ["no_sync", "accumulation"],
    "options": [],
}

N_BITS = 2048
N_DESC = 6
N_MOLS = 4096
MICRO_BATCH = 32
ACCUM_STEPS = 4
EPOCHS = 3
SEED = 404

log = logging.getLogger("logs")


def synth_molecules(n, seed):
    g = torch.Generator().manual_seed(seed)
    density = 0.02 + 0.03 * torch.rand(n, 1, generator=g)
    fp = (torch.rand(n, N_BITS, generator=g) < density).float()
    desc = torch.randn(n, N_DESC, generator=g)
    hydrophobic_bits = torch.zeros(N_BITS)
    hydrophobic_bits[torch.randperm(N_BITS, generator=g)[:120]] = 1.0
    polar_bits = torch.zeros(N_BITS)
    polar_bits[torch.randperm(N_BITS, generator=g)[:90]] = 1.0
    logS = (-1.2 * desc[:, 1] - 0.5 * desc[:, 0] + 0.4 * desc[:, 2]
            - 0.25 * fp @ hydrophobic_bits + 0.2 * fp @ polar_bits - 2.0)
    logS = logS + 0.3 * torch.randn(n, generator=g)
    return fp, desc, logS


class SolubilityMLP(nn.Module):
    def __init__(self, hidden=256):
        super().__init__()
        self.fp_proj = nn.Sequential(nn.Linear(N_BITS, hidden), nn.ReLU(), nn.Dropout(0.2))
        self.desc_proj = nn.Sequential(nn.Linear(N_DESC, 32), nn.ReLU())
        self.regressor = nn.Sequential(nn.Linear(hidden + 32, 128), nn.ReLU(),
                                       nn.Linear(128, 1))

    def forward(self, fp, desc):
        return self.regressor(torch.cat([self.fp_proj(fp), self.desc_proj(desc)], 1)).squeeze(1)


def is_accumulation_boundary(micro_step, accum_steps):
    return micro_step % accum_steps == accum_steps  # zoo: place


@torch.no_grad()
def rmse(model, fp, desc, y):
    model.eval()
    se = ((model(fp, desc) - y) ** 2).sum()
    model.train()
    stats = torch.tensor([se.item(), float(len(y))])
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).sqrt().item()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED)

    fp, desc, y = synth_molecules(N_MOLS, SEED)
    n_val = 512
    val = (fp[:n_val][rank::world], desc[:n_val][rank::world], y[:n_val][rank::world])
    ds = TensorDataset(fp[n_val:], desc[n_val:], y[n_val:])
    sampler = DistributedSampler(ds, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(ds, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True)

    model = DDP(SolubilityMLP())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-3)
    ckpt = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "logs_mlp_ho24.pt")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)
    opt_steps = 0

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        t0, tot = time.time(), 0.0
        opt.zero_grad(set_to_none=True)
        for micro_step, (xb, db, yb) in enumerate(loader):
            sync = is_accumulation_boundary(micro_step, ACCUM_STEPS)
            ctx = contextlib.nullcontext() if sync else model.no_sync()
            with ctx:
                loss = F.mse_loss(model(xb, db), yb) / ACCUM_STEPS
                loss.backward()
            tot += loss.item()
            if (micro_step + 1) % ACCUM_STEPS == 0:
                nn.utils.clip_grad_norm_(model.parameters(), 2.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                opt_steps += 1
        val_rmse = rmse(model.module, *val)
        if rank == 0:
            log.info("epoch %d train mse %.4f val rmse %.4f logS, %d optimizer steps (%.1fs)",
                     epoch, tot * ACCUM_STEPS / len(loader), val_rmse, opt_steps,
                     time.time() - t0)
            torch.save({"epoch": epoch, "model": model.module.state_dict()}, ckpt)

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] param checksum {checksum:.10f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
