"""Every 7th step rank 0 runs a "weight spectrum monitor" between optimizer.step() and the next
forward. Its first call builds a cache (a bank of orthonormal probe directions per layer and a
full singular-value decomposition of every weight, ~300 ms); later calls only refresh the top
singular values by power iteration against the cached probes (~60 ms). Rank 1 waits for rank 0
at the next gradient all-reduce every time."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "periodic_rank_work", "rank": 0,
          "fix": ["background", "less often", "asynchronous", "every rank"], "options": []}

STEPS = 70
PERIOD = 7


class SpectrumMonitor:
    def __init__(self) -> None:
        self.cache = None

    def _build(self, model: nn.Module) -> dict:
        gen = torch.Generator().manual_seed(1)
        cache = {}
        for name, p in model.named_parameters():
            if p.dim() != 2:
                continue
            w = p.detach()
            candidates = []
            for _ in range(16):
                q, _r = torch.linalg.qr(torch.randn(w.shape[1], w.shape[1], generator=gen))
                candidates.append(q[:, :16])
            # keep the 6 probe blocks that capture the most of the weight's energy
            energy = torch.stack([(w @ c).norm() for c in candidates])
            keep = energy.topk(min(6, len(candidates))).indices.tolist()
            probes = torch.cat([candidates[i] for i in keep], dim=1)
            cache[name] = {"probes": probes, "svals": torch.linalg.svdvals(w)}
        return cache

    def __call__(self, model: nn.Module) -> dict:
        if self.cache is None:
            self.cache = self._build(model)
        top = {}
        for name, p in model.named_parameters():
            if name not in self.cache:
                continue
            w = p.detach()
            v = self.cache[name]["probes"]
            for _ in range(18):
                u = w @ v
                v = w.t() @ u
                v = v / v.norm(dim=0, keepdim=True).clamp_min(1e-12)
                v, _r = torch.linalg.qr(v)
            top[name] = (w @ v).norm(dim=0).max().item()
        return top


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * 16, 48), torch.randint(0, 6, (STEPS * 16,)))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    model = DDP(nn.Sequential(nn.Linear(48, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(),
                              nn.Linear(384, 6)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = SpectrumMonitor()
    spectrum = {}
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % PERIOD == PERIOD - 1:
            spectrum = monitor(model.module)  # zoo: place
    if rank == 0:
        print(f"final loss {loss.item():.3f}, top singular values tracked: {len(spectrum)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
