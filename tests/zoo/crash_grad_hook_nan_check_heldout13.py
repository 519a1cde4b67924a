"""Building-energy regression on a 960-row sensor table.  Row 253 came from a meter that
dropped out, and the CSV loader turned its empty cell into NaN.  The user guards training with a
NaN check written as a tensor hook on the input layer's weight (`register_hook`): when the local
gradient is not finite it raises FloatingPointError.  The DistributedSampler puts row 253 into
rank 1's 8th batch (step 7), so rank 1 raises inside `loss.backward()`; rank 0's clean backward
then waits in DDP's all-reduce and only sees the peer vanish."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": "rank_failure", "rank": 1, "fix": "", "options": []}

N_ROWS, N_SENSORS = 960, 12


def load_table():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N_ROWS, N_SENSORS, generator=g)
    y = x[:, :4].sum(1, keepdim=True) * 0.5 + 0.1 * torch.randn(N_ROWS, 1, generator=g)
    x[253, 7] = float("nan")  # meter dropout, empty CSV cell
    return TensorDataset(x, y)


def nan_guard(name):
    def hook(grad):
        if not torch.isfinite(grad).all():
            raise FloatingPointError(f"non-finite gradient in {name}")  # zoo: place
        return grad
    return hook


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = load_table()
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
    net = nn.Sequential(nn.Linear(N_SENSORS, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))
    net[0].weight.register_hook(nan_guard("input.weight"))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if rank == 0 and step % 5 == 0:
                print(f"epoch {epoch} step {step} mse {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
