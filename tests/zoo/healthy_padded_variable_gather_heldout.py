"""HEALTHY: gathering per-rank predictions of different lengths, done right.

At evaluation time each rank has a different number of validation examples
(the validation split is sharded without padding: 101 vs 100 rows), so the
prediction tensors have different lengths.  `gather_variable()` first
all_gathers the lengths, pads every rank's tensor to the max length, does one
all_gather of equal-sized tensors and strips the padding.  All ranks then
compute the same global accuracy.  Different per-rank sizes around a
collective look like a size mismatch, but the collective itself is always
called with equal sizes.  Evaluation uses the DDP model under no_grad on
every rank.  Exits 0.

Expected: no warning, no error.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None


def gather_variable(t):
    world = dist.get_world_size()
    n = torch.tensor([t.shape[0]])
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.cat([t, t.new_zeros(max_n - t.shape[0], *t.shape[1:])])
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(201, 10, generator=g)
    ys = (xs.sum(1) > 0).long()
    val_x, val_y = xs[rank::world], ys[rank::world]   # 101 rows on rank 0, 100 on rank 1

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tg = torch.Generator().manual_seed(10 + rank)
    for epoch in range(3):
        model.train()
        for _step in range(20):
            x = torch.randn(32, 10, generator=tg)
            y = (x.sum(1) > 0).long()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            pred = model(val_x).argmax(1)
        pairs = gather_variable(torch.stack([pred, val_y], 1))
        acc = (pairs[:, 0] == pairs[:, 1]).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch}: {len(pairs)} val rows, acc {acc:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
