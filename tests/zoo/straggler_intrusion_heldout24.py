"""Network intrusion detector (flow statistics + payload byte features) trained with DDP.

Story
-----
Each training example is a network flow: 20 flow-level statistics (duration, packet and byte
counts, inter-arrival times, ...) plus the first 1 KiB of payload.  Payload bytes are turned into
a byte histogram, a hashed bigram histogram and an entropy score, concatenated with the flow
statistics and fed to an MLP that predicts benign / dos / portscan / bruteforce / exfiltration.

Because the payload features are expensive, the job pre-computes them once per shard with a
vectorised implementation (`build_payload_cache`).  Batches whose flows are not in the cache fall
back to the per-flow reference implementation `payload_features_reference()`.

Root cause
----------
The cache is only built under `if is_main_process():` (the guard was copied from the code that
used to write the cache to shared disk), so rank 0 has a cache and rank 1 does not.  Every step
rank 1 recomputes the payload features of its whole batch with the slow pure-Python reference
code, adding tens of milliseconds per step before its forward pass; rank 0 then idles inside
DDP's gradient all-reduce waiting for rank 1.  Nothing fails - the job is just as slow as its
slowest rank.
Fix: build the payload cache on every rank (each for its own shard), i.e. drop the rank-0 guard.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): exit code 0 in ~8 s.
Rank 1 logs 40-47 ms/step of payload-feature time, rank 0 0.2 ms/step; both ranks' step time is
45-53 ms (rank 0 waits for rank 1).  With the cache built on both ranks (fix) the step time is
5-7 ms.  Parameter checksums equal on both ranks.
"""
import logging
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": ["straggler"],
    "rank": 1,
    "fix": ["cache", "rank"],
    "options": [],
}

CLASSES = ["benign", "dos", "portscan", "bruteforce", "exfil"]
N_FLOW_STATS = 20
PAYLOAD = 1024
BIGRAM_BUCKETS = 64
N_TRAIN = 8192
N_VAL = 1024
BATCH = 256
EPOCHS = 4
SEED = 31337

log = logging.getLogger("ids")


def is_main_process():
    return dist.get_rank() == 0


def synth_flows(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.multinomial(torch.tensor([0.55, 0.12, 0.12, 0.11, 0.10]), n, True, generator=g)
    stats = torch.randn(n, N_FLOW_STATS, generator=g)
    stats[:, 0] += (y == 1).float() * 1.5 - (y == 2).float() * 1.2   # duration
    stats[:, 3] += (y == 4).float() * 2.0                            # bytes out
    stats[:, 7] += (y == 3).float() * 1.0                            # failed logins
    payload = torch.empty(n, PAYLOAD, dtype=torch.uint8)
    lo = torch.tensor([32, 0, 0, 65, 0])[y]
    hi = torch.tensor([127, 4, 2, 91, 256])[y]
    r = torch.rand(n, PAYLOAD, generator=g)
    payload[:] = (lo.unsqueeze(1) + r * (hi - lo).unsqueeze(1)).long().clamp(0, 255).to(torch.uint8)
    return stats, payload, y


def payload_features_fast(payload):
    """Vectorised byte histogram + hashed bigrams + entropy (used to fill the cache)."""
    p = payload.long()
    hist = torch.zeros(len(p), 256).scatter_add_(1, p, torch.ones_like(p, dtype=torch.float))
    hist /= PAYLOAD
    big = (p[:, :-1] * 31 + p[:, 1:]) % BIGRAM_BUCKETS
    bhist = torch.zeros(len(p), BIGRAM_BUCKETS).scatter_add_(1, big, torch.ones_like(big).float())
    bhist /= PAYLOAD - 1
    ent = -(hist * torch.log2(hist.clamp(min=1e-12))).sum(1, keepdim=True) / 8.0
    return torch.cat([hist, bhist, ent], 1)


def payload_features_reference(payload):
    """Per-flow reference implementation (readable, but pure Python)."""
    rows = []
    for flow in payload.tolist():
        hist = [0] * 256
        bhist = [0] * BIGRAM_BUCKETS
        prev = None
        for b in flow:
            hist[b] += 1
            if prev is not None:
                bhist[(prev * 31 + b) % BIGRAM_BUCKETS] += 1
            prev = b
        ent = 0.0
        for c in hist:
            if c:
                q = c / PAYLOAD
                ent -= q * math.log2(q)
        rows.append([c / PAYLOAD for c in hist] + [c / (PAYLOAD - 1) for c in bhist] + [ent / 8.0])
    return torch.tensor(rows)


def build_payload_cache(payload):
    return payload_features_fast(payload)


class FlowClassifier(nn.Module):
    def __init__(self, hidden=128):
        super().__init__()
        d_in = N_FLOW_STATS + 256 + BIGRAM_BUCKETS + 1
        self.stats_norm = nn.LayerNorm(N_FLOW_STATS)
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, hidden // 2), nn.GELU(),
                                 nn.Linear(hidden // 2, len(CLASSES)))

    def forward(self, stats, pfeat):
        return self.net(torch.cat([self.stats_norm(stats), pfeat], 1))


@torch.no_grad()
def macro_f1(model, stats, pfeat, y):
    pred = model(stats, pfeat).argmax(1)
    f1s = []
    for c in range(len(CLASSES)):
        tp = ((pred == c) & (y == c)).sum().float()
        fp = ((pred == c) & (y != c)).sum().float()
        fn = ((pred != c) & (y == c)).sum().float()
        f1s.append((2 * tp / (2 * tp + fp + fn).clamp(min=1)).item())
    return sum(f1s) / len(f1s)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED)

    stats, payload, y = synth_flows(N_TRAIN, SEED)
    shard = torch.arange(N_TRAIN)[rank::world]
    stats, payload, y = stats[shard], payload[shard], y[shard]
    cache = build_payload_cache(payload) if is_main_process() else None
    log.info("shard: %d flows, payload cache %s", len(y), "ready" if cache is not None else "off")

    v_stats, v_payload, v_y = synth_flows(N_VAL, SEED + 1)
    v_feat = payload_features_fast(v_payload)

    model = DDP(FlowClassifier())
    counts = torch.bincount(y, minlength=len(CLASSES)).float()
    dist.all_reduce(counts)
    weights = (counts.sum() / counts).clamp(max=10.0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(SEED + rank)
    ckpt = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "ids_flowclf_ho24.pt")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)
    steps = len(y) // BATCH
    data_time = 0.0

    for epoch in range(EPOCHS):
        perm = torch.randperm(len(y), generator=gen)
        t0, tot, data_time = time.time(), 0.0, 0.0
        for step in range(steps):
            idx = perm[step * BATCH:(step + 1) * BATCH]
            td = time.perf_counter()
            if cache is not None:  # noqa: SIM108
                pfeat = cache[idx]
            else:
                pfeat = payload_features_reference(payload[idx])  # zoo: place
            data_time += time.perf_counter() - td
            logits = model(stats[idx], pfeat)
            loss = F.cross_entropy(logits, y[idx], weight=weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item()
        elapsed = time.time() - t0
        log.info("epoch %d loss %.4f data %.1f ms/step, step %.1f ms", epoch, tot / steps,
                 1000 * data_time / steps, 1000 * elapsed / steps)
        if rank == 0:
            f1 = macro_f1(model.module, v_stats, v_feat, v_y)
            log.info("epoch %d val macro-F1 %.3f", epoch, f1)
            torch.save({"epoch": epoch, "model": model.module.state_dict()}, ckpt)
        dist.barrier()

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] param checksum {checksum:.10f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
