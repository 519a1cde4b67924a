"""Seismic phase picker: noise / P-arrival / S-arrival classification of 3-component
waveform windows, trained with DDP (gloo, CPU).

What the job does
    A small 1-D CNN classifies 4 s, 100 Hz, 3-component (E, N, Z) seismogram windows
    from a deterministic synthetic catalogue (damped wavelets at random onsets on top of
    microseismic noise).  The catalogue is sharded with DistributedSampler (in catalogue
    order).  After every optimizer step a monitoring helper, report_strong_motion(),
    looks for strong-motion windows (peak amplitude above the trigger level) in the
    batch; when it finds one it gathers the candidate picks of every worker with
    dist.all_gather_object() so rank 0 can print a network-wide event summary.

Root cause
    The helper decides *locally* whether to gather: it returns early when its own batch
    has no strong-motion window.  The only aftershock window in the catalogue
    (index 171) lands in rank 1's shard (step 5 of epoch 0), so rank 1 alone calls
    all_gather_object() while rank 0 goes on to the next step and blocks in the DDP
    gradient all-reduce of step 6.  The two ranks sit in different collectives forever
    (until the 30 min process-group timeout).

Fix
    Make the decision collectively: all_reduce the local trigger flag (ReduceOp.MAX)
    and let every rank call all_gather_object() when any rank triggered (an empty pick
    list is fine), or gather the picks unconditionally on all ranks every N steps.

Observed (plain run: OMP_NUM_THREADS=1 timeout 90 torchrun --standalone --nproc_per_node 2)
    Hangs.  Exit code 124 (killed by `timeout 90` after 90 s; torchrun then SIGTERMs
    both workers).  The only training output is "epoch 0 step 0 loss 1.1228"; the
    last lines are torchrun's "Received 15 death signal, shutting down workers" and
    its SignalException traceback.  A faulthandler stack dump taken during the hang
    (separate instrumented run) showed rank 1 inside dist.all_gather_object ->
    all_gather called from report_strong_motion() after its step 5, and rank 0 inside
    loss.backward() of step 6 (its 7th backward) waiting for the gradient all-reduce.
"""
import gc
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = {
    "kind": ["hang", "rank_only_collective", "collective_mismatch"],
    "rank": 1,
    "fix": ["all ranks", "every rank", "all_reduce", "unconditional"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

SEED = 1234
N_WINDOWS = 512
WIN_LEN = 400
SAMPLING_HZ = 100.0
BATCH = 16
EPOCHS = 3
LR = 1e-3
STRONG_MOTION_TRIGGER = 6.0          # counts after gain correction
# catalogue entries from the aftershock sequence, recorded with the gain left at "high"
AFTERSHOCK_IDS = (171,)
OUT_DIR = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "seismic_picker")
PHASES = ("noise", "P", "S")


class WaveformCatalogue(Dataset):
    """Deterministic synthetic 3-C windows: label 0 = noise, 1 = P arrival, 2 = S arrival."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 3, (n,), generator=g)
        self.onsets = torch.randint(60, 300, (n,), generator=g)
        self.freqs = 2.0 + 6.0 * torch.rand(n, generator=g)
        self.amps = 0.5 + torch.rand(n, generator=g)
        for i in AFTERSHOCK_IDS:
            self.amps[i] = 40.0
            self.labels[i] = 2
        self.seed = seed
        self.t = torch.arange(WIN_LEN, dtype=torch.float32) / SAMPLING_HZ

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(self.seed * 7919 + idx)
        x = 0.1 * torch.randn(3, WIN_LEN, generator=g)
        label = int(self.labels[idx])
        if label > 0:
            onset = int(self.onsets[idx])
            tt = self.t[: WIN_LEN - onset]
            wavelet = self.amps[idx] * torch.exp(-2.5 * tt) * torch.sin(2 * math.pi * self.freqs[idx] * tt)
            if label == 1:                      # P: mostly vertical
                x[2, onset:] += wavelet
                x[:2, onset:] += 0.3 * wavelet
            else:                               # S: mostly horizontal
                x[:2, onset:] += wavelet
                x[2, onset:] += 0.3 * wavelet
        return x, label


class PhasePicker(nn.Module):
    def __init__(self, n_classes=3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(3, 16, 7, padding=3), nn.ReLU(), nn.MaxPool1d(4),
            nn.Conv1d(16, 32, 7, padding=3), nn.ReLU(), nn.MaxPool1d(4),
            nn.Conv1d(32, 32, 5, padding=2), nn.ReLU(),
        )
        self.head = nn.Linear(32, n_classes)

    def forward(self, x):
        # per-window amplitude normalisation, as in most pickers
        x = x / (x.abs().amax(dim=(1, 2), keepdim=True) + 1e-6)
        h = self.features(x).mean(dim=-1)
        return self.head(h)


def report_strong_motion(step, waveforms, probs, worker):
    peak = waveforms.abs().amax(dim=(1, 2))
    hits = (peak > STRONG_MOTION_TRIGGER).nonzero().flatten()
    if hits.numel() == 0:
        return
    picks = [
        {"worker": worker, "step": step, "peak": round(float(peak[i]), 2),
         "phase": PHASES[int(probs[i].argmax())], "p_S": round(float(probs[i, 2]), 3)}
        for i in hits.tolist()
    ]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, picks)  # zoo: place
    if dist.get_rank() == 0:
        flat = [p for worker_picks in everyone for p in worker_picks]
        print(f"[event] step {step}: {len(flat)} strong-motion picks: {flat}", flush=True)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)

    catalogue = WaveformCatalogue(N_WINDOWS, SEED)
    sampler = DistributedSampler(catalogue, shuffle=False)
    loader = DataLoader(catalogue, batch_size=BATCH, sampler=sampler)

    model = DDP(PhasePicker())
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        for waveforms, labels in loader:
            logits = model(waveforms)
            loss = F.cross_entropy(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            report_strong_motion(step, waveforms, logits.detach().softmax(-1), f"worker{rank}")
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            step += 1

    if rank == 0:
        os.makedirs(OUT_DIR, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(OUT_DIR, "picker.pt"))
    dist.barrier()
    if rank == 0:
        print("training done", flush=True)
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
