"""A prefetch thread dies on a truncated record; the training loop waits on its queue -> hang.

Story: spectrogram clips are stored as flat float records with a (bins, frames) header.  To
hide the decode cost, each rank runs a `Prefetcher`: a daemon thread decodes and batches its
shard's records and puts the batches into a bounded queue; the training loop takes batches
with `queue.get()`.  Rank 0's shard file has a record the upstream export truncated, so the
`view(bins, frames)` in the decoder raises RuntimeError inside the thread.  Nothing catches
it: the thread prints its traceback and dies, and rank 0's main thread blocks forever in
`queue.get()` waiting for a batch that will never come.  Rank 1 keeps training and waits in
DDP's gradient all-reduce of the next step for rank 0.

Root cause: rank 0 (blocked in its own code, waiting on a dead background thread).
Fix: catch the exception in the thread and pass it (or a sentinel) through the queue so the
main thread re-raises it, or use `queue.get(timeout=...)` and check the thread is alive.
"""

import queue
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)

EXPECT = {
    "kind": ["hang"],
    "rank": 0,
    "fix": ["thread", "exception", "sentinel", "timeout", "is_alive", "re-raise", "reraise"],
    "options": ["--hang-timeout", "6", "--on-hang", "kill"],
}

BINS, FRAMES = 16, 20


def load_shard(rank, n=384):
    """The shard "file": a list of (header, flat values, label) records."""
    g = torch.Generator().manual_seed(1000 + rank)
    records = []
    for i in range(n):
        label = int(torch.randint(0, 3, (1,), generator=g))
        spec = torch.randn(BINS, FRAMES, generator=g) + label * torch.linspace(0, 1, FRAMES)
        values = spec.flatten().tolist()
        if rank == 0 and i == 211:  # shard-00000 was cut short by the exporter at this record
            values = values[: BINS * FRAMES - 7]
        records.append(((BINS, FRAMES), values, label))
    return records


class Prefetcher:
    def __init__(self, records, batch_size, depth=4):
        self.records = records
        self.batch_size = batch_size
        self.queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._work, name="prefetch", daemon=True)
        self.thread.start()

    def _decode(self, record):
        (bins, frames), values, label = record
        return torch.tensor(values).view(bins, frames), label  # zoo: place

    def _work(self):
        for start in range(0, len(self.records), self.batch_size):
            decoded = [self._decode(r) for r in self.records[start:start + self.batch_size]]
            xs = torch.stack([d[0] for d in decoded])
            ys = torch.tensor([d[1] for d in decoded])
            self.queue.put((xs, ys))
        self.queue.put(None)

    def __iter__(self):
        while True:
            item = self.queue.get()  # zoo: place
            if item is None:
                return
            yield item


class ClipNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(BINS, 24, 3, padding=1)
        self.fc = nn.Linear(24, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(-1))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(ClipNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    records = load_shard(rank)

    for epoch in range(3):
        for step, (xb, yb) in enumerate(Prefetcher(records, batch_size=32)):
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 4 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
