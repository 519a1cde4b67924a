"""Tabular churn classifier; after each epoch every rank scores its slice of the validation set
(a strided split, val[rank::world]) and all_gathers each batch's logits to build a global
confusion matrix. 203 validation rows split 102/101, so rank 1's last batch holds 33 rows
while rank 0's holds 34: the all_gather sizes disagree on that batch and the job fails."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

EXPECT = {
    "kind": "collective_mismatch",
    "rank": None,  # two ranks, each with its own size: neither is the odd one out
    "fix": ["pad", "same size", "distributedsampler", "all_gather_object", "sizes"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

N_FEATURES = 24


def make_churn_table(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=g)
    w = torch.linspace(-1.0, 1.0, N_FEATURES)
    y = ((x @ w + 0.5 * torch.randn(n, generator=g)) > 0.3).long()
    return TensorDataset(x, y)


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
def global_confusion(model, loader, world):
    model.eval()
    confusion = torch.zeros(2, 2, dtype=torch.long)
    for x, y in loader:
        logits = model(x)
        payload = torch.cat([logits, y.unsqueeze(1).float()], dim=1)
        gathered = [torch.zeros_like(payload) for _ in range(world)]
        dist.all_gather(gathered, payload)  # zoo: place
        allp = torch.cat(gathered)
        pred, true = allp[:, :2].argmax(1), allp[:, 2].long()
        confusion.index_put_((true, pred), torch.ones_like(true), accumulate=True)
    model.train()
    return confusion


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    train = make_churn_table(2048, seed=1)
    val = make_churn_table(203, seed=2)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    train_loader = DataLoader(train, batch_size=32, sampler=sampler, drop_last=True)
    val_loader = DataLoader(Subset(val, list(range(rank, len(val), world))), batch_size=34)

    model = DDP(ChurnMLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    for epoch in range(3):
        sampler.set_epoch(epoch)
        for _step, (x, y) in enumerate(train_loader):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        cm = global_confusion(model, val_loader, world)
        if rank == 0:
            acc = cm.diag().sum().item() / cm.sum().item()
            print(f"epoch {epoch} loss {loss.item():.3f} val acc {acc:.3f}\n{cm}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
