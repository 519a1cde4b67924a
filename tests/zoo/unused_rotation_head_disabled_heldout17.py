"""Fine-tuning run that keeps the self-supervised rotation head of the pretraining recipe but
never calls it: find_unused_parameters=True hides the problem, the head never trains.

Story: a small CNN for 10-class 32x32 images, from a recipe whose pretraining stage adds a
rotation-prediction head (predict 0/90/180/270 degrees) with weight ROT_WEIGHT.  For
fine-tuning ROT_WEIGHT defaults to 0.0 and `forward` skips the head when the weight is 0 --
but the head is still built and handed to DDP and the optimizer.  The first try crashed with
DDP's "Expected to have finished reduction" error, so the author set
find_unused_parameters=True.  Now it runs: every step DDP walks the autograd graph to find
rot_head's parameters unused and marks them ready itself, rot_head never gets a gradient on
any rank, and the "rotation accuracy" the author later reads from this checkpoint is the
random init.  No error.

Root cause: rot_head (rot_head.0.weight, rot_head.0.bias, rot_head.2.weight, rot_head.2.bias)
never used in any step on any rank (no single rank at fault).
Right diagnosis: unused_parameters (a parameter no rank trained in any step, with the flag on).
Fix: do not build the head (or freeze it / requires_grad=False) when ROT_WEIGHT is 0, then
turn find_unused_parameters off.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = {
    "kind": "unused_parameters",
    "rank": None,
    "fix": ["rot_head", "remove", "delete", "requires_grad", "freeze", "loss",
            "find_unused_parameters", "never used", "not used"],
    "names": ["rot_head"],
    "options": [],
}

ROT_WEIGHT = float(os.environ.get("ROT_WEIGHT", "0.0"))
BATCH = 32
EPOCHS = 4


def make_images(n, seed):
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(10, 3, 8, 8, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    x = F.interpolate(protos[labels], size=32, mode="bilinear", align_corners=False)
    x = x + 0.6 * torch.randn(n, 3, 32, 32, generator=g)
    return TensorDataset(x, labels)


class SmallCnn(nn.Module):
    def __init__(self, rot_weight):
        super().__init__()
        self.rot_weight = rot_weight
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 24, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(24, 48, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(48, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.cls_head = nn.Linear(64, 10)
        self.rot_head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x, x_rot=None):
        logits = self.cls_head(self.backbone(x))
        if self.rot_weight > 0 and x_rot is not None:
            return logits, self.rot_head(self.backbone(x_rot))
        return logits, None


def rotate_batch(x):
    k = torch.randint(0, 4, (x.shape[0],))
    return torch.stack([torch.rot90(img, int(r), dims=(1, 2)) for img, r in zip(x, k)]), k


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = make_images(2048, seed=5)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = DDP(SmallCnn(ROT_WEIGHT), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x_rot, rot_y = rotate_batch(x) if ROT_WEIGHT > 0 else (None, None)
            logits, rot_logits = model(x, x_rot)
            loss = F.cross_entropy(logits, y)
            if rot_logits is not None:
                loss = loss + ROT_WEIGHT * F.cross_entropy(rot_logits, rot_y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            step += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
