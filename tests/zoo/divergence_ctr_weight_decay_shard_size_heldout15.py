"""Click-through-rate model (user/item embeddings + small MLP) trained on daily click logs.
Each rank reads its own days of logs (rank r takes days r, r+2, ...) and draws a fixed number
of minibatches per epoch from them, so both ranks always take the same number of steps. The
L2 penalty follows the usual "prior strength / number of training examples" recipe, but the
example count is len() of the rank's own shard: rank 0 holds three days, rank 1 two, so the
ranks run SGD with different weight_decay. No error, no hang; the averaged gradients are
identical, yet the decay shrinks the replicas by different amounts every step and their
weights drift apart."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": None,
    "rank": None,
    "fix": [],
    "options": [],
    "names": [["weight decay", "weight_decay", "l2 penalty", "regulari", "hyperparameter"]],
    "never": [],
}

N_USERS, N_ITEMS, N_DAYS = 300, 120, 5
DAY_SIZES = [900, 700, 1100, 800, 1000]


def load_day(day: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + day)
    users = torch.randint(0, N_USERS, (DAY_SIZES[day],), generator=g)
    items = torch.randint(0, N_ITEMS, (DAY_SIZES[day],), generator=g)
    taste = torch.Generator().manual_seed(7)
    u_vec, i_vec = torch.randn(N_USERS, 4, generator=taste), torch.randn(N_ITEMS, 4, generator=taste)
    logit = (u_vec[users] * i_vec[items]).sum(1) - 0.5
    clicks = (torch.rand(len(users), generator=g) < torch.sigmoid(logit)).float()
    return users, items, clicks


class CTRModel(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.user = nn.Embedding(N_USERS, dim)
        self.item = nn.Embedding(N_ITEMS, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.user(users), self.item(items)], 1)).squeeze(1)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    days = [load_day(d) for d in range(rank, N_DAYS, world)]
    users, items, clicks = (torch.cat(parts) for parts in zip(*days))
    n_examples = len(clicks)
    prior_strength = 6.0

    model = DDP(CTRModel())
    opt = torch.optim.SGD(
        model.parameters(), lr=0.2, momentum=0.9,
        weight_decay=prior_strength / n_examples,  # zoo: place
    )
    picker = torch.Generator().manual_seed(100 + rank)
    steps_per_epoch, batch = 40, 64

    for epoch in range(6):
        running = 0.0
        for _ in range(steps_per_epoch):
            idx = torch.randint(0, n_examples, (batch,), generator=picker)
            loss = nn.functional.binary_cross_entropy_with_logits(model(users[idx], items[idx]), clicks[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += loss.item()
        if rank == 0:
            print(f"epoch {epoch} train logloss {running / steps_per_epoch:.4f}", flush=True)

    checksum = sum(p.detach().double().sum().item() for p in model.module.parameters())
    print(f"[rank {rank}] shard {n_examples} examples, final weight checksum {checksum:.10f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
