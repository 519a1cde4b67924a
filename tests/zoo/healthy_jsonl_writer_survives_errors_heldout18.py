"""Healthy twin: a background metrics writer that survives bad records, so join() returns.

Story: every rank streams its per-step metrics to its own JSONL file through a background
`MetricsWriter` thread fed by a queue; at the end of each epoch the trainer calls
`writer.flush()` (queue.join()) so the file is complete before the epoch's checkpoint.
Some records cannot be serialised: every 8th step the record carries the gradient norm
returned by clip_grad_norm_, a tensor, and json.dumps raises TypeError.  The writer catches
the exception, counts the dropped record and calls task_done() in a finally block, so the
thread stays alive and join() always returns.  Both ranks keep stepping together.

Expected: no warning, no error.
"""

import json
import os
import queue
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

EXPECT = None


class MetricsWriter:
    def __init__(self, path):
        self.path = path
        self.queue = queue.Queue()
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="metrics-writer", daemon=True)
        self.thread.start()

    def _run(self):
        with open(self.path, "w") as f:
            while True:
                record = self.queue.get()
                try:
                    if record is None:
                        return
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                except (TypeError, ValueError):
                    self.dropped += 1
                finally:
                    self.queue.task_done()

    def log(self, **record):
        self.queue.put(record)

    def flush(self):
        self.queue.join()

    def close(self):
        self.queue.put(None)
        self.thread.join()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    g = torch.Generator().manual_seed(11)
    x = torch.randn(2048, 16, generator=g)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1.5).long()) % 4
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)

    log_dir = os.path.join(tempfile.gettempdir(), "flow_metrics")
    os.makedirs(log_dir, exist_ok=True)
    writer = MetricsWriter(os.path.join(log_dir, f"rank{rank}.jsonl"))
    step = 0
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            record = {"epoch": epoch, "step": step, "loss": loss.item()}
            if step % 8 == 0:
                record["grad_norm"] = grad_norm  # a tensor: json.dumps refuses it
            writer.log(**record)
            step += 1
        writer.flush()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} (dropped {writer.dropped} log records)",
                  flush=True)
            torch.save(model.module.state_dict(), os.path.join(log_dir, "last.pt"))

    writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
