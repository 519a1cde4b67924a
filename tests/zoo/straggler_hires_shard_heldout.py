"""One rank's data shard needs an expensive resize in the input pipeline (straggler).

Each rank reads its own image shard, listed in a config dict.  Shard 0 was
exported already at the training resolution (32x32); shard 1 was exported
from the raw camera dump at 128x128, so `ImageShard._to_train_res()` on rank 1
anti-alias-blurs (3 reflect-padded depthwise convs) and downsamples every
sample in the DataLoader (num_workers=0, so in the training process).  Rank 1
spends about 60 ms more per step fetching its batch; rank 0 waits for it in
the gradient all_reduce every step.  Nothing crashes; the job is just slow.

Root cause: rank 1 (slow data loading / input pipeline).
Right diagnosis: straggler, rank 1, time spent in data loading, not compute.
Fix: preprocess shard 1 offline to the training resolution (same as shard 0),
or move the resize into DataLoader workers (num_workers>0).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

EXPECT = {
    "kind": None,
    "rank": 1,
    "fix": ["loader", "num_workers", "preprocess", "input pipeline", "resize", "augment",
            "worker", "data load", "data pipeline"],
    "options": [],
}

CONFIG = {
    "train_res": 32,
    "shards": [
        {"name": "train-00000", "stored_res": 32},
        {"name": "train-00001", "stored_res": 128},   # raw export, never resized
    ],
    "batch_size": 16,
    "steps": 60,
}


class ImageShard(Dataset):
    def __init__(self, shard_cfg, train_res, n=CONFIG["batch_size"] * CONFIG["steps"]):
        self.res = shard_cfg["stored_res"]
        self.train_res = train_res
        self.n = n
        self.seed = int(shard_cfg["name"].split("-")[-1])
        self.kernel = torch.full((3, 1, 5, 5), 1 / 25.0)

    def __len__(self):
        return self.n

    def _to_train_res(self, img):
        if img.shape[-1] == self.train_res:
            return img
        for _ in range(3):  # anti-alias before downsampling
            img = F.conv2d(F.pad(img, (2, 2, 2, 2), mode="reflect"), self.kernel, groups=3)
        return F.interpolate(img, size=(self.train_res, self.train_res), mode="bilinear")

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        img = torch.rand(1, 3, self.res, self.res, generator=g)
        img = self._to_train_res(img)[0]
        label = int(img.mean() > 0.5)
        return img, label


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.fc = nn.Linear(16, 2)

    def forward(self, x):
        x = F.relu(self.c1(x))
        x = F.relu(self.c2(x))
        return self.fc(x.mean((2, 3)))


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = ImageShard(CONFIG["shards"][rank], CONFIG["train_res"])
    loader = DataLoader(ds, batch_size=CONFIG["batch_size"], shuffle=False, num_workers=0)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
