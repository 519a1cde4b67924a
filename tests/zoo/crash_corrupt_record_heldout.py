"""A malformed record in one rank's shard raises in the Dataset (crash on one rank).

Training data is a list of CSV lines "label,f0,f1,...".  `CsvRecords.__getitem__`
parses each line with `float()`.  Rank 1's shard contains one truncated line
(written by an interrupted export job): "3,0.12,0.5,,". When rank 1's
DataLoader reaches it, `float('')` raises ValueError and rank 1 dies.  Rank 0
is left waiting in the gradient all_reduce of that step and then fails with a
gloo connection error -- its error is only a consequence.

Root cause: rank 1 (ValueError while parsing a record in CsvRecords.__getitem__).
Right diagnosis: crash of rank 1 caused by bad input data; rank 0's error is
secondary.
Fix: repair/validate the corrupt record in shard 1 (or skip malformed lines
when parsing).
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["record", "corrupt", "malformed", "valueerror", "pars", "skip", "bad data",
            "dataset", "__getitem__"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

N_FEAT = 8


def export_shard(rank, n=480):
    g = torch.Generator().manual_seed(rank + 10)
    lines = []
    for _i in range(n):
        x = torch.rand(N_FEAT, generator=g)
        label = int(x[:4].sum() > x[4:].sum())
        lines.append(",".join([str(label)] + [f"{v:.4f}" for v in x.tolist()]))
    if rank == 1:
        lines[301] = "3,0.12,0.5,,"    # interrupted export
    return lines


class CsvRecords(Dataset):
    def __init__(self, lines):
        self.lines = lines

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, i):
        label, *feats = self.lines[i].split(",")
        x = torch.tensor([float(v) for v in feats])  # zoo: place
        return x, int(label)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(N_FEAT, 32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(CsvRecords(export_shard(rank)), batch_size=16)
    for epoch in range(2):
        for _step, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
