"""Customer-support ticket router (per-product queue + shared priority head), trained with DDP.

Story
-----
Support tickets for four product lines (billing portal, mobile app, router firmware, smart
thermostat) are routed to a product-specific queue and given a priority.  A hashed bag-of-words
encoder is shared; each product line has its own routing head (different numbers of queues),
and a shared head predicts priority.  Batches are bucketed by product so each step trains
exactly one routing head, chosen by the data.

Why it looks suspicious but is healthy
--------------------------------------
* Which routing head is used depends on the batch, and each rank draws its own batches, so in the
  same step rank 0 may update the "firmware" head while rank 1 updates the "billing" head, and
  some heads are not used by any rank in a given step.
* This is exactly what `find_unused_parameters=True` is for: DDP marks the locally-unused heads
  as ready, averages in zeros for them, hands the averaged gradient to every rank for heads used
  on any rank, and leaves heads unused on all ranks without a gradient on all ranks - so the
  optimizer updates the same parameters by the same amounts on both ranks.
Expected: exits 0, both ranks print the same parameter checksum.

Plain run (measured, torchrun --nproc_per_node 2, gloo, 2 CPUs): exit code 0 in ~8 s; route
accuracy 0.979, priority accuracy 0.988; ranks train a different routing head in 31 of the 40
steps of epoch 0; parameter checksum 1913.5294404997 on both ranks.
"""
import logging
import os
import tempfile
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None

PRODUCTS = {
    "billing": ["refund", "invoice", "card_declined", "plan_change"],
    "mobile": ["login", "crash", "notifications"],
    "firmware": ["update_failed", "wifi_drop", "port_forward", "reset", "bricked"],
    "thermostat": ["schedule", "sensor", "hvac_wiring"],
}
PRIORITIES = ["low", "normal", "urgent"]
HASH_BUCKETS = 1 << 13
MAX_TOKENS = 24
BATCH = 32
EPOCHS = 3
SEED = 2718

log = logging.getLogger("router")


def h(word):
    return 1 + zlib.crc32(word.encode()) % (HASH_BUCKETS - 1)   # 0 is padding


def synth_tickets(n_per_product, seed):
    g = torch.Generator().manual_seed(seed)
    filler = [f"w{i}" for i in range(300)]
    out = {}
    for p, queues in PRODUCTS.items():
        toks, q, pr = [], [], []
        for _ in range(n_per_product):
            qi = int(torch.randint(0, len(queues), (1,), generator=g))
            pri = int(torch.multinomial(torch.tensor([0.4, 0.45, 0.15]), 1, generator=g))
            words = [p, queues[qi], queues[qi] + "_err", ["meh", "please", "asap"][pri]]
            words += [filler[int(i)] for i in torch.randint(0, 300, (14,), generator=g)]
            if pri == 2:
                words += ["down", "outage"]
            ids = [h(w) for w in words][:MAX_TOKENS]
            perm = torch.randperm(len(ids), generator=g).tolist()
            ids = [ids[i] for i in perm] + [0] * (MAX_TOKENS - len(ids))
            toks.append(ids)
            q.append(qi)
            pr.append(pri)
        out[p] = (torch.tensor(toks), torch.tensor(q), torch.tensor(pr))
    return out


class TicketRouter(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.bag = nn.EmbeddingBag(HASH_BUCKETS, dim, mode="mean", padding_idx=0)
        self.encoder = nn.Sequential(nn.Linear(dim, 128), nn.ReLU(), nn.Dropout(0.1),
                                     nn.Linear(128, 64), nn.ReLU())
        self.route = nn.ModuleDict({p: nn.Linear(64, len(q)) for p, q in PRODUCTS.items()})
        self.priority = nn.Linear(64, len(PRIORITIES))

    def forward(self, tokens, product):
        z = self.encoder(self.bag(tokens))
        return self.route[product](z), self.priority(z)


def product_batches(shard, gen):
    """Yield (product, idx) batches, bucketed by product, in a random product order."""
    plan = []
    for p, (toks, _, _) in shard.items():
        perm = torch.randperm(len(toks), generator=gen)
        plan += [(p, perm[i:i + BATCH]) for i in range(0, len(perm) - BATCH + 1, BATCH)]
    order = torch.randperm(len(plan), generator=gen).tolist()
    return [plan[i] for i in order]


@torch.no_grad()
def evaluate(model, val):
    model.eval()
    stats = torch.zeros(3)
    for p, (toks, q, pr) in val.items():
        r, s = model(toks, p)
        stats += torch.tensor([(r.argmax(1) == q).sum().item(), (s.argmax(1) == pr).sum().item(),
                               float(len(q))])
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(SEED)

    data = synth_tickets(640, SEED)
    val = synth_tickets(120, SEED + 1)
    shard = {p: tuple(t[rank::world] for t in v) for p, v in data.items()}
    val = {p: tuple(t[rank::world] for t in v) for p, v in val.items()}
    gen = torch.Generator().manual_seed(SEED + rank)   # each rank shuffles its own shard

    model = DDP(TicketRouter(), find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    ckpt = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo", "ticket_router_ho24.pt")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)

    for epoch in range(EPOCHS):
        plan = product_batches(shard, gen)
        n_steps = torch.tensor([len(plan)])
        dist.all_reduce(n_steps, op=dist.ReduceOp.MIN)
        t0, tot = time.time(), 0.0
        for product, idx in plan[:int(n_steps)]:
            toks, q, pr = (t[idx] for t in shard[product])
            route_logits, pri_logits = model(toks, product)
            loss = F.cross_entropy(route_logits, q) + 0.5 * F.cross_entropy(pri_logits, pr)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item()
        route_acc, pri_acc = evaluate(model.module, val)
        if rank == 0:
            log.info("epoch %d loss %.4f route acc %.3f priority acc %.3f (%.1fs)", epoch,
                     tot / int(n_steps), route_acc, pri_acc, time.time() - t0)
            torch.save({"epoch": epoch, "model": model.module.state_dict()}, ckpt)
        dist.barrier()

    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] param checksum {checksum:.10f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
