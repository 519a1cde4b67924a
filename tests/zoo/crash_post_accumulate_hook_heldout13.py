"""Click-through model trained on user sessions; the collate function flattens each batch of
sessions into one batch of events and the loss is summed per event, so a long session weighs
more.  A gradient-norm budget guards the output layer: a post-accumulate-grad hook
(`register_post_accumulate_grad_hook`) on `head.weight` raises RuntimeError when the local
gradient norm is over budget.  Session 143 is a crawler with 600 events; the DistributedSampler
puts it into rank 0's 6th batch (step 5), whose event batch is ~40x larger than usual, so rank 0
raises inside `loss.backward()` while rank 1 is left waiting on the all-reduce."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EXPECT = {"kind": "rank_failure", "rank": 0, "fix": "", "options": []}

GRAD_BUDGET = 40.0


class Sessions(Dataset):
    def __init__(self, n=512):
        g = torch.Generator().manual_seed(2)
        lens = torch.randint(1, 7, (n,), generator=g)
        lens[143] = 600  # crawler traffic that the bot filter missed
        self.events = [torch.randn(int(k), 10, generator=g) for k in lens]
        self.clicks = [(e[:, 0] + e[:, 3] > 0.5).float() for e in self.events]

    def __len__(self):
        return len(self.events)

    def __getitem__(self, i):
        return self.events[i], self.clicks[i]


def flatten_sessions(batch):
    return torch.cat([e for e, _ in batch]), torch.cat([c for _, c in batch])


def grad_budget(param):
    norm = param.grad.norm().item()
    if norm > GRAD_BUDGET:
        raise RuntimeError(f"head.weight grad norm {norm:.1f} exceeds budget {GRAD_BUDGET}")  # zoo: place


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = Sessions()
    sampler = DistributedSampler(data, seed=7)
    loader = DataLoader(data, batch_size=8, sampler=sampler, collate_fn=flatten_sessions)
    net = nn.Sequential(nn.Linear(10, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU())
    net.head = nn.Linear(48, 1)
    net.head.weight.register_post_accumulate_grad_hook(grad_budget)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(x).squeeze(1), y, reduction="sum")
        loss.backward()
        opt.step()
        if rank == 0 and step % 4 == 0:
            print(f"step {step} events {len(y)} loss {loss.item():.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
