"""Each rank broadcasts its own seed, `dist.broadcast(t, src=rank)`: same op, dtype and size,
but the ranks disagree on the root, so gloo blocks forever (no backend is at fault)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "collective_mismatch", "rank": None, "fix": "src", "options": ["--hang-timeout", "6", "--on-hang", "kill"]}


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
    seed = torch.tensor([1234 + rank])
    dist.broadcast(seed, src=rank)  # zoo: place
    print(seed.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
