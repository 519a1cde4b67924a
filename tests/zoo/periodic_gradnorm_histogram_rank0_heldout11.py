"""Every 10th step rank 0 builds a "gradient norm histogram" for monitoring: for every
parameter it recomputes per-row gradient norms and bins them at many resolutions (pure
tensor work, ~60 ms) between optimizer.step() and the next forward. Rank 1 has nothing to
do and waits for rank 0 at the next gradient all-reduce."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "periodic_rank_work", "rank": 0,
          "fix": ["background", "less often", "asynchronous", "every rank"], "options": []}

STEPS = 80
PERIOD = 10


def grad_norm_histogram(model: nn.Module, rounds: int = 40) -> dict:
    hists = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().reshape(p.grad.shape[0], -1)
        acc = torch.zeros(64)
        for r in range(rounds):
            norms = (g * (1.0 + 0.01 * r)).pow(2).sum(dim=1).sqrt()
            logn = torch.log10(norms + 1e-12)
            acc += torch.histc(logn, bins=64, min=-8.0, max=2.0)
            acc += torch.histc(g.abs().flatten().add(1e-12).log10(), bins=64, min=-8.0, max=2.0)
        hists[name] = acc / rounds
    return hists


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * 16, 32), torch.randint(0, 8, (STEPS * 16,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    last = None
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % PERIOD == PERIOD - 1:
            last = grad_norm_histogram(model.module)  # zoo: place
    if rank == 0 and last is not None:
        print(f"final loss {loss.item():.3f}, histogram of {len(last)} tensors")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
