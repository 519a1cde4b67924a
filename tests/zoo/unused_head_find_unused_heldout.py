"""A contrastive head left over from pre-training is still registered (`aux_head`) but no
forward uses it; the job runs with find_unused_parameters=True, so DDP quietly skips it every
step on every rank. Nothing fails: the parameter is dead weight that no rank ever trains, and
the flag costs a graph walk per step. A right diagnosis is a warning naming aux_head."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {
    "kind": None, "rank": None, "fix": ["remove", "delete", "drop"], "names": ["aux_head"], "options": [],
}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.cls_head = nn.Linear(32, 4)
        self.aux_head = nn.Linear(32, 128)  # zoo: place

    def forward(self, x):
        return self.cls_head(self.backbone(x))


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = DDP(Model(), find_unused_parameters=True)  # zoo: place
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
