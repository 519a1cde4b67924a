"""Small CNN whose activation-health report syncs the layers "most dead first", ranked with an
argsort over each rank's own activation statistics.

The job: a 4-layer network (three conv layers, one hidden linear layer) classifies 16x16
grayscale images of simple shapes (disc, square, cross, ring) drawn at random places with noise.
An `ActivationMonitor` puts forward hooks on the four ReLUs and keeps, per layer, the mean
activation and the fraction of zero outputs of every channel: one tensor per layer of
2 x channels numbers (16, 32, 48 and 64 numbers). Every 4 steps `log_health` ranks the layers
by their fraction of dead units (most dead first, which is what the team reads first), and the
monitor all-reduces the layers' tensors one by one in that order before printing.

The bug: the ranking is a `torch.argsort` over each rank's own, not yet reduced, statistics.
For a long time the layers' dead fractions are far enough apart (or move together on both
ranks) that both ranks rank them the same way, even when the order changes; later the third
and fourth layers sit within a few thousandths of each other and the ranks rank them
differently (in the 58th report, at step 232 with these seeds): at the second position rank 0
all-reduces the 48-number tensor of the third layer and rank 1 the 64-number tensor of the
fourth. The sizes do not match and the job fails there.

Fix: rank the layers after the all-reduce (on the global statistics), or sync them in a fixed
order (the layer order) and sort only the printed lines.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EXPECT = {"kind": None, "rank": None, "fix": [], "options": ["--hang-timeout", "8", "--on-hang", "kill"]}

EPOCHS = 20
REPORT_EVERY = 4


def make_shapes(n=1024, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    label = torch.randint(0, 4, (n,), generator=g)
    cy = 4 + 8 * torch.rand(n, generator=g)
    cx = 4 + 8 * torch.rand(n, generator=g)
    r = 2.5 + 1.5 * torch.rand(n, generator=g)
    images = torch.zeros(n, 1, size, size)
    for k in range(n):
        dy, dx = ys - cy[k], xs - cx[k]
        dist_c = torch.sqrt(dy ** 2 + dx ** 2)
        if label[k] == 0:
            img = dist_c < r[k]
        elif label[k] == 1:
            img = (dy.abs() < r[k]) & (dx.abs() < r[k])
        elif label[k] == 2:
            img = ((dy.abs() < 0.8) & (dx.abs() < r[k])) | ((dx.abs() < 0.8) & (dy.abs() < r[k]))
        else:
            img = (dist_c < r[k]) & (dist_c > r[k] - 1.2)
        images[k, 0] = img.float()
    images += 0.3 * torch.randn(images.shape, generator=g)
    return TensorDataset(images, label)


class ShapeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.act1 = nn.Conv2d(1, 8, 3, padding=1), nn.ReLU()
        self.conv2, self.act2 = nn.Conv2d(8, 16, 3, padding=1), nn.ReLU()
        self.conv3, self.act3 = nn.Conv2d(16, 24, 3, padding=1), nn.ReLU()
        self.fc, self.act4 = nn.Linear(24 * 4 * 4, 32), nn.ReLU()
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        x = F.max_pool2d(self.act1(self.conv1(x)), 2)
        x = F.max_pool2d(self.act2(self.conv2(x)), 2)
        x = self.act3(self.conv3(x))
        return self.out(self.act4(self.fc(x.flatten(1))))


class ActivationMonitor:
    def __init__(self, model):
        self.names = ["act1", "act2", "act3", "act4"]
        self.stats, self.seen = {}, {}
        for name in self.names:
            module = getattr(model, name)
            channels = {"act1": 8, "act2": 16, "act3": 24, "act4": 32}[name]
            self.stats[name] = torch.zeros(2 * channels)
            self.seen[name] = 0
            module.register_forward_hook(self._hook(name, channels))

    def _hook(self, name, channels):
        def hook(module, inputs, output):
            with torch.no_grad():
                out = output.detach()
                dims = [0, 2, 3] if out.dim() == 4 else [0]
                self.stats[name][:channels] += out.mean(dims)
                self.stats[name][channels:] += (out == 0).float().mean(dims)
                self.seen[name] += 1
        return hook

    def dead_fraction(self):
        return torch.tensor([
            self.stats[n][self.stats[n].numel() // 2:].mean().item() / max(self.seen[n], 1)
            for n in self.names])

    def sync(self, order):
        for i in order:
            dist.all_reduce(self.stats[self.names[i]])

    def reset(self):
        for name in self.names:
            self.stats[name].zero_()
            self.seen[name] = 0


def log_health(monitor, step, rank):
    order = torch.argsort(monitor.dead_fraction(), descending=True).tolist()  # zoo: place
    monitor.sync(order)
    if rank == 0:
        world = dist.get_world_size()
        lines = []
        for i in order:
            name = monitor.names[i]
            half = monitor.stats[name].numel() // 2
            dead = monitor.stats[name][half:].mean().item() / (monitor.seen[name] * world)
            lines.append(f"{name} dead {dead:.3f}")
        print(f"step {step} activation health: " + ", ".join(lines), flush=True)
    monitor.reset()


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = make_shapes()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    net = ShapeNet()
    monitor = ActivationMonitor(net)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for images, label in loader:
            loss = F.cross_entropy(model(images), label)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % REPORT_EVERY == 0:
                log_health(monitor, step, rank)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
