"""Each rank filters its own shard (drops records shorter than a threshold) and rank 1's shard
has more short records: rank 1 runs out of batches two steps before rank 0, reaches the epoch's
loss all_reduce and meets rank 0's gradient all-reduce there. The root is rank 1's shorter
data (uneven inputs); nobody calls a barrier."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

EXPECT = {
    "kind": None, "rank": 1, "fix": ["join", "DistributedSampler", "drop_last"],
    "never": ["skipped the barrier"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}


def filtered_shard(rank: int, world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(200, 16, generator=g), torch.randint(0, 4, (200,), generator=g)
    lengths = torch.arange(200) % 10 + 2
    if rank == 1:
        lengths[1::world][:16] = 1  # this shard's source had more truncated records
    keep = lengths[rank::world] > 1
    return TensorDataset(x[rank::world][keep], y[rank::world][keep])


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    loader = DataLoader(filtered_shard(rank, world), batch_size=8)  # zoo: place
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    total = torch.zeros(2)
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # zoo: place
        opt.step()
        total += torch.tensor([loss.item() * len(y), len(y)])
    dist.all_reduce(total)  # zoo: place
    if rank == 0:
        print(f"epoch loss {total[0] / total[1]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
