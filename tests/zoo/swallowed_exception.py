"""A bad batch raises on rank 1; the loop catches the exception, logs it and stops training on
that rank only. Rank 1 then exits cleanly; rank 0 waits for it in the next step."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "rank_left_early", "rank": 1, "fix": "exception", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for step, (x, y) in enumerate(loader):
            if rank == 1 and step == 3:
                raise ValueError("corrupt sample")
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)  # zoo: place
            loss.backward()
            opt.step()
    except ValueError as exc:
        print(f"rank {rank}: skipping the rest of training: {exc}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
