"""A DDP job whose every sync point is countable: STEPS_PER_EPOCH x EPOCHS steps, barriers.

Two ranks, 64 samples per rank per epoch, batch 8 -> 8 steps per epoch; 3 epochs -> 24 steps.
One eval pass per epoch (no_grad, through the wrapper, on every rank) -> 2 forwards each.
A barrier per epoch plus one at the end; one all_reduce of the eval metric per epoch.
The model is large enough for several gradient buckets (bucket_cap_mb=1).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = 3


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 32), torch.randint(0, 4, (128,)))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    evalset = DataLoader(TensorDataset(torch.randn(32, 32), torch.randint(0, 4, (32,))), batch_size=16)
    model = nn.Sequential(
        nn.Linear(32, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 4),
    )
    ddp = DDP(model, bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        ddp.train()
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        ddp.eval()
        correct = torch.zeros(1)
        with torch.no_grad():
            for x, y in evalset:
                correct += (ddp(x).argmax(1) == y).sum()
        dist.all_reduce(correct)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"epoch {epoch} correct {int(correct.item())}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
