"""Where the doctor's cost of a tiny training step goes: each probe's part, in its context.

``step_cost.py`` measures the whole cost by alternation, but on a shared 2-core VM its paired
differences spread by ±50 µs, more than any one part. Here one process (world size 1, gloo)
trains the tiny model with timing wrappers around each part the doctor adds: the DDP forward
probe (outer wrapper minus the wrapped forward), the backward probe, the C++ timer's drain
(within the backward while DDP lays out its buckets, then on the writer thread only: per step,
what that thread holds the GIL for), on the Python path only the run-queue read and the
unused-parameter check (the C probe does both inline), and the optimizer's pre and post
hooks with the fingerprint's after-step check. Parts are timed where they run, after autograd's
and the optimizer's own work, where a Python line costs several times what it costs in a
warm loop. Each wrapper adds about half a microsecond to what it measures; compare checkouts
side by side (``PYTHONPATH=CHECKOUT``), not against ``step_cost.py``.

    python benchmarks/probe_parts.py [--steps 4000] [--bucket-timing on|off] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

SPENT: collections.Counter[str] = collections.Counter()
_clock = time.perf_counter_ns


def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = _clock()
        try:
            return f(*args, **kwargs)
        finally:
            SPENT[name] += _clock() - t0

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--bucket-timing", default="on", choices=["on", "off"])
    ap.add_argument("--json", action="store_true", help="print only the one-line JSON result")
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
    os.environ["DDPDOCTOR_RUN_DIR"] = tempfile.mkdtemp(prefix="probe_parts_")
    os.environ["DDPDOCTOR_BUCKET_TIMING"] = args.bucket_timing
    import torch
    import torch.autograd
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    # The originals, timed before the probes wrap them: outer minus inner is the probe.
    DDP.forward = timed("inner_forward", DDP.forward)
    torch.autograd.backward = timed("inner_backward", torch.autograd.backward)
    import ddpdoctor.probes as probes
    from ddpdoctor.probes import commhook, ddp, fingerprint

    commhook.drain = timed("drain", commhook.drain)  # drain_settling and the writer thread call it
    probes.install()
    from torch.optim import optimizer as torch_optimizer  # the step hooks install registered

    for hooks, name in (
        (torch_optimizer._global_optimizer_pre_hooks, "optimizer_pre"),
        (torch_optimizer._global_optimizer_post_hooks, "optimizer_post"),
    ):
        for key, hook in list(hooks.items()):
            hooks[key] = timed(name, hook)
    ddp.run_queue_us = timed("run_queue", ddp.run_queue_us)  # the Python path's (in C: its own)
    ddp.check_unused = timed("unused_check", ddp.check_unused)
    fingerprint.after_step = timed("fingerprint", fingerprint.after_step)
    DDP.forward = timed("outer_forward", DDP.forward)
    torch.autograd.backward = timed("outer_backward", torch.autograd.backward)

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    model = DDP(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    steps(50)
    SPENT.clear()
    t0 = time.perf_counter()
    steps(args.steps)
    step_us = (time.perf_counter() - t0) / args.steps * 1e6
    us = {k: v / args.steps / 1e3 for k, v in SPENT.items()}
    parts = {
        "forward_probe": us.pop("outer_forward") - us.pop("inner_forward"),
        "backward_probe": us.pop("outer_backward") - us.pop("inner_backward"),
        **us,
    }
    total = sum(parts[k] for k in ("forward_probe", "backward_probe", "optimizer_pre", "optimizer_post"))
    result = {"step_us": round(step_us, 1), "total_us": round(total, 1)}
    result.update({k: round(v, 2) for k, v in parts.items()})
    dist.destroy_process_group()
    if args.json:
        print(json.dumps(result))
        return
    print(f"step {result.pop('step_us')} µs, of which the doctor's parts {result.pop('total_us')} µs:")
    print("  (backward_probe includes run_queue, unused_check; optimizer_post the fingerprint;")
    print("   drain is the writer thread's, after the first steps)")
    for key, value in result.items():
        print(f"  {key:16s} {value:6.2f} µs")


if __name__ == "__main__":
    sys.exit(main())
