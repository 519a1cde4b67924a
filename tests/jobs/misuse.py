"""Small DDP jobs with one classic mistake each (or none).

Usage: misuse.py {healthy|unused_head|branch|unneeded|no_sampler|no_set_epoch|two_models|
                  presplit|same_shard|reseeded|shadowed|epoch_once|epoch_fixed}

``shadowed``: the name ``sampler`` is reused for a validation sampler, so ``set_epoch`` reaches
that one and never the training loader's. ``epoch_once``: a resumed run sets its first epoch
once, before the loop; ``epoch_fixed``: it sets that same epoch at the start of every epoch.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BRANCH_STEPS = {3, 7}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.aux = nn.Linear(32, 2)  # an auxiliary head

    def forward(self, x, use_aux: bool = True):
        h = torch.relu(self.body(x))
        return self.head(h), (self.aux(h) if use_aux else None)


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 16), torch.randint(0, 4, (96,)))
    if mode == "no_sampler":
        loader = DataLoader(data, batch_size=8, shuffle=True)
        sampler = None
    elif mode == "presplit":  # each rank loads its own half (its own file, say): no sampler needed
        gen = torch.Generator().manual_seed(100 + dist.get_rank())
        data = TensorDataset(torch.randn(48, 16, generator=gen), torch.randint(0, 4, (48,), generator=gen))
        loader = DataLoader(data, batch_size=8, shuffle=True)
        sampler = None
    elif mode == "same_shard":  # a hard-coded rank: every process reads rank 0's shard
        sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=8, sampler=sampler)
    else:
        sampler = DistributedSampler(data, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=8, sampler=sampler)
    if mode == "shadowed":
        sampler = DistributedSampler(data, shuffle=False)  # for validation, under the same name
    model = DDP(Net(), find_unused_parameters=mode in ("branch", "unneeded"))
    params = list(model.parameters())
    critic = None
    if mode == "two_models":  # a second model that searches for unused parameters needlessly
        critic = DDP(nn.Linear(4, 1), find_unused_parameters=True)
        params += list(critic.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    step = 0
    start = 3  # a resumed run's first epoch
    if mode == "epoch_once":
        sampler.set_epoch(start)  # once, before the loop
    for epoch in range(2):
        if mode == "reseeded":  # no set_epoch, yet a new order each epoch: the seed moves instead
            sampler.seed = epoch
        elif mode == "epoch_fixed":
            sampler.set_epoch(start)  # the same epoch each time
        elif sampler is not None and mode not in ("no_set_epoch", "epoch_once"):
            sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            logits, aux = model(x, use_aux=not (mode == "branch" and step in BRANCH_STEPS))
            loss = nn.functional.cross_entropy(logits, y)
            if aux is not None and mode != "unused_head":
                loss = loss + aux.pow(2).mean()
            if critic is not None:
                loss = loss + critic(logits).pow(2).mean()
            loss.backward()
            opt.step()
            step += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
