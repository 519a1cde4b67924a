"""Per-class metrics all-reduced as one tensor whose length depends on the classes each rank
saw: the sizes differ by rank at the same collective and gloo aborts."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "collective_mismatch", "rank": None, "fix": "size", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    seen = sorted(set(y.tolist()))[: 2 + rank]  # the classes in this rank's last batch
    counts = torch.tensor([float(c) for c in seen])
    dist.all_reduce(counts)  # zoo: place
    print(counts.tolist())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
