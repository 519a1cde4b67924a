"""Camera-trap species classification with an optional bounding-box head.

A small CNN classifies synthetic camera-trap frames (fox / deer / boar / empty: blobs of
different size and brightness on a textured night background). Only some frames were
annotated with boxes; the box-regression head runs only when the batch has at least one
annotated frame, so on some steps -- different ones on each rank -- the box head's
parameters receive no gradient. The model is wrapped with find_unused_parameters=True,
which is exactly what this data-dependent graph needs, so DDP marks the skipped parameters
ready and the reduction completes every step. Each rank appends its own metrics to a per-rank
CSV in /tmp every 20 steps (same cost on every rank).

Root cause: none (healthy job).
Fix: nothing to fix.
"""


import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None

SPECIES = ["empty", "fox", "deer", "boar"]
S = 28


def synth_frames(n, seed, annotated_frac):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(S).float(), torch.arange(S).float(), indexing="ij")
    imgs, labels, boxes, has_box = [], [], [], []
    for _ in range(n):
        sp = int(torch.randint(0, 4, (1,), generator=g))
        img = 0.2 * torch.rand(S, S, generator=g) + 0.05 * torch.sin(xx / 2)
        box = torch.zeros(4)
        if sp:
            r = [0, 3.0, 6.0, 4.5][sp]
            cx, cy = 6 + 16 * torch.rand(2, generator=g)
            img += [0, 0.9, 0.6, 0.4][sp] * (((xx - cx) ** 2 + (yy - cy) ** 2) < r * r).float()
            box = torch.tensor([cx - r, cy - r, cx + r, cy + r]) / S
        imgs.append(img[None])
        labels.append(sp)
        boxes.append(box)
        has_box.append(bool(sp) and float(torch.rand(1, generator=g)) < annotated_frac)
    return torch.stack(imgs), torch.tensor(labels), torch.stack(boxes), torch.tensor(has_box)


class TrapNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.cls = nn.Linear(32, len(SPECIES))
        self.box = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x, want_boxes):
        f = self.backbone(x)
        return self.cls(f), (self.box(f).sigmoid() if want_boxes else None)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y, b, hb = synth_frames(1200, seed=60 + rank, annotated_frac=0.06)
    torch.manual_seed(0)
    model = DDP(TrapNet(), find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    log_path = f"/tmp/ho22_cameratrap_rank{rank}.csv"
    with open(log_path, "w") as f:
        f.write("step,loss,box_steps\n")
    bs, box_steps = 16, 0
    for step in range(100):
        i = (step * bs) % len(x)
        xb, yb, bb, hbb = x[i : i + bs], y[i : i + bs], b[i : i + bs], hb[i : i + bs]
        want = bool(hbb.any())
        logits, pred_box = model(xb, want)
        loss = F.cross_entropy(logits, yb)
        if want:
            loss = loss + 5 * F.l1_loss(pred_box[hbb], bb[hbb])
            box_steps += 1
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 19:
            with open(log_path, "a") as f:
                f.write(f"{step + 1},{loss.item():.4f},{box_steps}\n")
            print(
                f"rank {rank} step {step + 1} loss {loss.item():.3f} steps with box head {box_steps}",
                flush=True,
            )
    cs = torch.stack([p.detach().double().sum() for p in model.parameters()])
    out = [torch.zeros_like(cs) for _ in range(world)]
    dist.all_gather(out, cs)
    if rank == 0:
        print(
            "max |param checksum difference| across ranks:", (out[0] - out[1]).abs().max().item(), flush=True
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
