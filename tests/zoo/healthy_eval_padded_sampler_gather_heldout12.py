"""Tabular churn classifier; after each epoch every rank scores its slice of the 203-row
validation set and all_gathers each batch's logits to build a global confusion matrix.
Healthy: the slices come from DistributedSampler(shuffle=False), which pads to 102 rows per
rank, so every all_gather has the same size; padded duplicates are dropped by row index."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = None

N_FEATURES = 24


def make_churn_table(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=g)
    w = torch.linspace(-1.0, 1.0, N_FEATURES)
    y = ((x @ w + 0.5 * torch.randn(n, generator=g)) > 0.3).long()
    return x, y


class ChurnMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(N_FEATURES, 64), nn.BatchNorm1d(64), nn.ReLU(),
            nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2),
        )

    def forward(self, x):
        return self.net(x)


@torch.no_grad()
def global_confusion(model, loader, world, n_rows):
    model.eval()
    rows = []
    for x, y, idx in loader:
        payload = torch.cat([model(x), y.unsqueeze(1).float(), idx.unsqueeze(1).float()], dim=1)
        gathered = [torch.zeros_like(payload) for _ in range(world)]
        dist.all_gather(gathered, payload)
        rows.append(torch.cat(gathered))
    model.train()
    allp = torch.cat(rows)
    seen = torch.zeros(n_rows, dtype=torch.bool)
    confusion = torch.zeros(2, 2, dtype=torch.long)
    for logit0, logit1, true, i in allp.tolist():
        if seen[int(i)]:
            continue  # a row DistributedSampler repeated to pad the last rank
        seen[int(i)] = True
        confusion[int(true), int(logit1 > logit0)] += 1
    return confusion


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    train = TensorDataset(*make_churn_table(2048, seed=1))
    vx, vy = make_churn_table(203, seed=2)
    val = TensorDataset(vx, vy, torch.arange(len(vy)))
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    train_loader = DataLoader(train, batch_size=32, sampler=sampler, drop_last=True)
    val_loader = DataLoader(val, batch_size=34, sampler=DistributedSampler(val, shuffle=False))

    model = DDP(ChurnMLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    for epoch in range(3):
        sampler.set_epoch(epoch)
        for _step, (x, y) in enumerate(train_loader):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        cm = global_confusion(model, val_loader, world, len(val))
        if rank == 0:
            acc = cm.diag().sum().item() / cm.sum().item()
            print(f"epoch {epoch} loss {loss.item():.3f} val acc {acc:.3f} rows {cm.sum().item()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
