"""One bench mode in one process: ``single``, ``dp`` (instrumented DataParallel) or ``ddp``.

Run by ``ddpdoctor bench`` as a script: ``single`` and ``dp`` as ``python worker.py``, ``ddp``
under torchrun inside ``ddpdoctor run`` (so its breakdown also comes from the core probes).
Every process writes ``{mode}-rank{R}.json`` into ``--out`` and nothing to stdout, so
``bench --json`` prints exactly one JSON object. Timings are taken with the device synchronised
at phase boundaries: without that, CUDA timings measure kernel launches, not work.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, sys.path[0] is this directory: its models.py would shadow a user's `models`
# module. Put the current directory there instead (as `python -m` does) and make sure our own
# package is importable.
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.getcwd()
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

DP_PHASES = ("scatter", "replicate", "parallel_apply", "gather")


def _sync(devices: list[Any]) -> None:
    import torch

    for dev in devices:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


class _DPTimer:
    """Times DataParallel's four forward stages by wrapping them on the instance: DataParallel
    calls ``self.scatter`` etc., so an instance attribute takes the method's place."""

    def __init__(self, dp: Any, devices: list[Any]) -> None:
        self.devices = devices
        self.current: dict[str, float] = dict.fromkeys(DP_PHASES, 0.0)
        self.called: set[str] = set()  # with fewer than 2 GPUs DataParallel skips some stages
        for name in DP_PHASES:
            setattr(dp, name, self._wrap(name, getattr(dp, name)))

    def _wrap(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            _sync(self.devices)
            t0 = time.perf_counter()
            result = method(*args, **kwargs)
            _sync(self.devices)
            self.current[name] += time.perf_counter() - t0
            self.called.add(name)
            return result

        return timed

    def take(self) -> dict[str, float]:
        out, self.current = self.current, dict.fromkeys(DP_PHASES, 0.0)
        return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", required=True, help="ddp, or single and/or dp (comma-separated)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-shape", required=True)
    parser.add_argument("--batch-size", type=int, required=True, help="global batch")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--loss", default="cross_entropy")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    modes = args.mode.split(",")
    if not modes or not set(modes) <= {"single", "dp", "ddp"} or ("ddp" in modes and len(modes) > 1):
        parser.error("--mode: ddp alone, or single and/or dp")

    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # single and dp share one process (one torch import less: seconds on a small machine), one
    # after the other, each with its own warm-up.
    for mode in modes:
        args.mode = mode
        run_mode(args)
    return 0


def run_mode(args: Any) -> None:
    """Train ``args.steps`` + ``args.warmup`` steps in one mode; write this process's result."""
    import torch

    from ddpdoctor.bench import models

    shape = models.parse_shape(args.input_shape)
    assert shape is not None
    rank, world = 0, 1
    cuda = torch.cuda.is_available()
    devices: list[Any] = []
    if args.mode == "ddp":
        import torch.distributed as dist

        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        cuda = cuda and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    else:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if args.mode == "dp" and cuda:
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    elif device.type == "cuda":
        devices = [device]
    for dev in devices:
        torch.cuda.reset_peak_memory_stats(dev)

    batch = args.batch_size // world
    model = models.build(args.model, shape).to(device)
    timer: _DPTimer | None = None
    replicas = world
    if args.mode == "dp":
        model = torch.nn.DataParallel(model)
        replicas = max(1, len(model.device_ids))
        timer = _DPTimer(model, devices)
    elif args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    gen = torch.Generator(device="cpu").manual_seed(100 + rank)
    x = torch.randn((batch, *shape), generator=gen).to(device)
    with torch.no_grad():
        probe = models.build(args.model, shape).to(device)(x[:1])
    loss_fn, target_one = models.loss_and_target(args.loss, probe)
    target = target_one.expand(batch, *target_one.shape[1:]).contiguous()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    step_s: list[float] = []
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    if timer is not None:
        phases.update({name: [] for name in DP_PHASES})
    for i in range(args.warmup + args.steps):
        _sync(devices)
        t0 = time.perf_counter()
        loss = loss_fn(model(x), target)
        _sync(devices)
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        _sync(devices)
        t2 = time.perf_counter()
        optimizer.step()
        _sync(devices)
        t3 = time.perf_counter()
        dp_times = timer.take() if timer is not None else {}
        if i < args.warmup:
            continue
        step_s.append(t3 - t0)
        phases["forward"].append(t1 - t0)
        phases["backward"].append(t2 - t1)
        phases["optimizer"].append(t3 - t2)
        for name, seconds in dp_times.items():
            phases[name].append(seconds)
    if timer is not None:  # a stage DataParallel never ran has no time, not a time of 0
        for name in set(DP_PHASES) - timer.called:
            del phases[name]

    result = {
        "mode": args.mode,
        "rank": rank,
        "world_size": world,
        "replicas": replicas,
        "device": str(device),
        "devices": [str(d) for d in devices] or ["cpu"],
        "threads": torch.get_num_threads(),
        "batch_per_process": batch,
        "warmup": args.warmup,
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": step_s,
        "phases": phases,
        "memory_bytes": {str(d): int(torch.cuda.max_memory_allocated(d)) for d in devices},
        "final_loss": float(loss.detach()),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.mode}-rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    if args.mode == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
