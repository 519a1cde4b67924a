"""Replicas that drift apart, and healthy twins that must not: one mode per argv[1].

not_synced        a head unfrozen after wrapping, a parameter added after wrapping, and a
                  module left out of DDP, all trained by the optimizer (never all-reduced)
ckpt_before       rank 0 loads a checkpoint before wrapping (the constructor broadcasts it)
bn_no_broadcast   BatchNorm with broadcast_buffers=False (statistics differ by rank: a note)
autocast          bf16 autocast on CPU with gradient_as_bucket_view=True
skip_steps        rank 1 skips optimizer.step() at steps 3, 10 and 17 by its own decision
rollback          rank 1 puts its head's weights back to a saved copy (under no_grad) at steps
                  5, 12 and 19 by its own decision
copy_after        rank 0 writes its head's weights in place (copy_ under no_grad) right after
                  wrapping: no load_state_dict, only the version counter says which rank
join_sgd          each rank its own shard, rank 0's 8 batches to rank 1's 12, under DDP's Join
                  context; SGD without momentum: rank 0 shadows rank 1's extra all-reduces and
                  Join re-syncs the weights at its exit: healthy, though the ranks' step counts
                  part (rank 0's step N is rank 1's N + 4 in the second epoch)
join_momentum     the same with momentum 0.9: rank 0's momentum buffers fall behind, and the
                  replicas part in the second epoch
never_synced      a gradient accumulation boundary test that never holds: every backward runs
                  under no_sync(), so DDP reduces nothing and each rank steps on its own gradients

With RELEASE_FILE set, every rank waits after its first optimizer step until that file exists
(the live test runs `ddpdoctor top` meanwhile).
"""

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32) if bn else nn.Identity()
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        out = self.head(torch.relu(self.norm(self.body(x))))
        scale = getattr(self, "scale", None)
        return out * scale if scale is not None else out


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(160, 16), torch.randint(0, 4, (160,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    joined = mode.startswith("join_")
    if joined:  # each rank its own shard, of its own length: uneven on purpose
        g = torch.Generator().manual_seed(rank)
        n = 64 if rank == 0 else 96
        own = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
        loader = DataLoader(own, batch_size=8)
    net = Net(bn=mode == "bn_no_broadcast")
    side = None
    if mode == "ckpt_before":
        path = os.path.join(os.environ.get("CKPT_DIR", "."), "pretrained.pt")
        if rank == 0:
            torch.save({k: torch.randn_like(v) for k, v in net.state_dict().items()}, path)
            net.load_state_dict(torch.load(path))
    if mode == "not_synced":
        net.head.requires_grad_(False)
    options = {"broadcast_buffers": False} if mode == "bn_no_broadcast" else {}
    if mode == "autocast":
        options = {"gradient_as_bucket_view": True}
    model = DDP(net, **options)
    if mode == "copy_after" and rank == 0:
        with torch.no_grad():
            net.head.weight.copy_(torch.randn_like(net.head.weight))
    params = list(model.parameters())
    if mode == "not_synced":
        net.head.requires_grad_(True)
        net.scale = nn.Parameter(torch.ones(4))
        side = nn.Linear(16, 4)
        params = list(model.parameters()) + list(side.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.0 if mode == "join_sgd" else 0.9)
    saved = net.head.weight.detach().clone()  # the rollback's copy
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        with model.join(enable=joined):
            step = train(mode, rank, model, opt, loader, side, net, saved, step)
    dist.destroy_process_group()


def train(mode, rank, model, opt, loader, side, net, saved, step):  # noqa: ANN001, ANN201
    for x, y in loader:
        opt.zero_grad()
        boundary = mode != "never_synced" or (step + 1) % 4 == 4  # the test never holds there
        ctx = contextlib.nullcontext() if boundary else model.no_sync()
        with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            out = model(x) + (side(x) if side is not None else 0)
            loss = nn.functional.cross_entropy(out.float(), y)
        loss.backward()
        if mode == "clip_rank0" and rank == 0:  # a norm for rank 0's log, clipping as it reads
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)
        if not (mode == "skip_steps" and rank == 1 and step % 7 == 3):  # a rank-local skip
            opt.step()
        if mode == "rollback" and rank == 1 and step % 7 == 5:  # a rank-local rollback
            with torch.no_grad():
                net.head.weight.copy_(saved)
        step += 1
        while os.environ.get("RELEASE_FILE") and not os.path.exists(os.environ["RELEASE_FILE"]):
            time.sleep(0.05)
    return step


if __name__ == "__main__":
    main(sys.argv[1])
