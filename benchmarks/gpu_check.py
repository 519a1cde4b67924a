"""The device-span checks, on a machine with one or more NVIDIA GPUs (not runnable without one).

With N >= 2 GPUs: NCCL, one rank per GPU. With one GPU: gloo with CUDA tensors, 2 ranks on it.
A DDP MLP trains STEPS steps under `ddpdoctor run`; rank SLOW gets ``torch.cuda._sleep`` (a
device-side busy wait, invisible to CPU timestamps) in its backward, before its last gradient
bucket is ready. Then it asserts:

1. the straggler finding names rank SLOW, in backward, measured on the device clock;
2. every bucket all-reduce has a non-zero device time, and each step's last reduction ends
   after the step's last gradient was ready on the device;
3. the step time from device spans (training forward starts) is within 5 % of the wall time
   per step the job measured itself (it syncs with ``loss.item()`` every step);
4. the model fingerprints (probes/fingerprint.py) were computed on the device and written on
   every rank at construction and after step 0, the ranks' parameters agree, and no
   divergence is reported (a healthy job);
5. and reports the overhead: median step time under ddpdoctor vs plain torchrun, over TRIALS
   interleaved pairs (plain and doctor alternate, so drift in the machine hits both), and the
   fingerprint's cost on this GPU per million parameters (device time, and the launch time
   the training thread pays), measured in this process with CUDA events.

    PYTHONPATH=. python benchmarks/gpu_check.py [--steps 60] [--sleep-ms 20] [--trials 3] [--out DIR]

Exit 0 when every check passes, 1 when one fails, 2 when there is no GPU. The checks are
plain functions over a read run (``check_*``), unit-tested on CPU with simulated runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 0.05


def plan(n_gpus: int) -> tuple[str, int]:
    """(backend, ranks): NCCL with one rank per GPU, or gloo with 2 ranks on the only GPU."""
    if n_gpus <= 0:
        raise SystemExit("gpu_check: no CUDA GPU here (torch.cuda.device_count() == 0)")
    return ("nccl", n_gpus) if n_gpus >= 2 else ("gloo", 2)


# -- the checks (CPU-testable) ------------------------------------------------------------


def check_straggler(findings: list[dict[str, Any]], slow: int) -> str | None:
    """None if a straggler finding names ``slow`` in backward on the device clock, else why not."""
    found = [f for f in findings if f.get("kind", "").startswith("straggler")]
    for f in found:
        d = f.get("details", {})
        if f.get("ranks") == [slow] and d.get("phase") == "backward" and d.get("clock") == "device":
            return None
    seen = [(f["ranks"], f["details"]) for f in found]
    return f"no device-clock straggler in backward for rank {slow}: {seen}"


def check_buckets(run: Any) -> str | None:
    """Device all-reduce times are non-zero, and each step's last one ends after its last
    gradient was ready."""
    from ddpdoctor.trace import schema

    for rank, trace in sorted(run.ranks.items()):
        ar = trace.kind(schema.DEV_ALLREDUCE)
        if not len(ar):
            return f"rank {rank}: no device all-reduce spans"
        if (ar.dur <= 0).any():
            return f"rank {rank}: {int((ar.dur <= 0).sum())} device all-reduces of zero length"
        for step in np.unique(ar.step).tolist():
            mine = ar.step == step
            if int(ar.end[mine].max()) <= int(ar.ts[mine].max()):
                return f"rank {rank} step {step}: the last reduction ends before the last bucket is ready"
    return None


def device_step_s(run: Any, skip: int = 5) -> float:
    """Median time between training forward starts on the device, over every rank (s)."""
    from ddpdoctor.trace import schema

    periods = []
    for trace in run.ranks.values():
        fwd = trace.kind(schema.DEV_FORWARD)
        training = np.sort(fwd.ts[fwd.ints(0) == 1])[skip:]
        periods.append(np.diff(training))
    return float(np.median(np.concatenate(periods))) / 1e6 if periods else 0.0


def check_step_time(device_s: float, wall_s: float) -> str | None:
    if wall_s <= 0 or abs(device_s - wall_s) > TOLERANCE * wall_s:
        return f"step time from device spans {device_s * 1e3:.2f} ms vs wall {wall_s * 1e3:.2f} ms (> 5 %)"
    return None


def check_fingerprints(run: Any, findings: list[dict[str, Any]]) -> str | None:
    """Every rank fingerprinted at construction and after step 0, the ranks' parameters agree
    at every check they share, and no finding says otherwise."""
    from ddpdoctor.trace import schema

    seen: dict[int, dict[tuple[int, str], list[int]]] = {}
    for rank, trace in sorted(run.ranks.items()):
        records = [(step, info) for _, step, info in trace.meta.get(schema.FINGERPRINT, [])]
        records = [(s, i) for s, i in records if i.get("model") == 0]
        if [i.get("at") for _, i in records][:2] != ["init", "step"]:
            return f"rank {rank}: no fingerprint at construction and after step 0"
        params = int(records[0][1].get("n_params", 0))
        seen[rank] = {(s, i["at"]): list(i.get("values", []))[:params] for s, i in records}
    ranks = sorted(seen)
    for key, values in seen[ranks[0]].items():
        for rank in ranks[1:]:
            other = seen[rank].get(key)
            if other is not None and other != values:
                return f"rank {rank} differs from rank {ranks[0]} at {key}"
    loud = [f["kind"] for f in findings if f["kind"] in ("weights_diverged", "gradients_not_synced")]
    return f"divergence reported on a healthy job: {loud}" if loud else None


def fingerprint_cost(torch: Any, params: int = 100_000_000, tensors: int = 200) -> dict[str, float]:
    """The fingerprint on this GPU: device ms and launch (CPU) ms per million parameters."""
    from ddpdoctor.probes import fingerprint as fp

    size = params // tensors
    data = [torch.randn(size, device="cuda") for _ in range(tensors)]
    fp.hashes(data[:2])  # warm-up: weights on the device, kernels loaded
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    t0 = time.perf_counter()
    values = torch.stack([fp.tensor_hash(t) for t in data])
    launch_s = time.perf_counter() - t0
    end.record()
    end.synchronize()
    assert values.shape == (tensors,)
    per_m = params / 1e6
    return {
        "fingerprint_device_ms_per_mparam": round(start.elapsed_time(end) / per_m, 5),
        "fingerprint_launch_ms_per_tensor": round(launch_s * 1e3 / tensors, 4),
    }


# -- the job ------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One rank: DDP MLP on its GPU; the slow rank sleeps on the device inside backward."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    local = int(os.environ["LOCAL_RANK"])
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    device = torch.device("cuda", local if args.backend == "nccl" else 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    layers = [nn.Linear(args.width, args.width) for _ in range(6)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())]).to(device)
    ddp = DDP(model, device_ids=[device.index] if args.backend == "nccl" else None, bucket_cap_mb=8)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width, device=device)
    cycles = _cycles_per_ms(torch) * args.sleep_ms if rank == args.slow else 0

    def slow_down(grad: Any) -> Any:  # in backward, before the first layer's gradients
        torch.cuda._sleep(int(cycles))
        return grad

    def hook_output(module: Any, inputs: Any, output: Any) -> None:  # None: the output stays
        output.register_hook(slow_down)

    if cycles:  # the first layer's parameters sit in the last bucket DDP reduces
        model[1].register_forward_hook(hook_output)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = ddp(x).square().mean()
        loss.backward()
        opt.step()
        loss.item()  # the job's own sync point, once a step
        times.append(time.perf_counter() - t0)
    Path(args.out_dir, f"steps-rank{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def _cycles_per_ms(torch: Any) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def _launch(args: argparse.Namespace, backend: str, nproc: int, out: Path, doctor: bool) -> float:
    """One job, plain or under ddpdoctor (its run dir ``out/run``): its median step time (s)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [__file__, "--worker", "--backend", str(backend), "--out-dir", str(out)]
    cmd += ["--steps", str(args.steps), "--sleep-ms", str(args.sleep_ms), "--slow", str(args.slow)]
    cmd += ["--width", str(args.width), "--batch", str(args.batch)]
    if doctor:
        cmd = [sys.executable, "-m", "ddpdoctor", "run", "--out", str(out / "run"), "--", *cmd]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    # every bucket timed: its device spans are what is checked (auto would leave most GPU steps
    # untimed), unless the caller chose
    env.setdefault("DDPDOCTOR_BUCKET_TIMING", "on")
    subprocess.run(cmd, check=True, env=env)
    steps = [json.loads(p.read_text()) for p in sorted(out.glob("steps-rank*.json"))]
    return statistics.median(t for ranks in steps for t in ranks[5:])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--backend", default="")
    p.add_argument("--out-dir", default="")
    p.add_argument("--out", default="")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sleep-ms", type=float, default=20.0)
    p.add_argument("--slow", type=int, default=1)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--trials", type=int, default=3, help="interleaved plain/doctor pairs")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    import torch

    try:
        backend, nproc = plan(torch.cuda.device_count())
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    from ddpdoctor.analysis import diagnose
    from ddpdoctor.trace.reader import load_run

    if args.trials < 1:
        p.error("--trials must be at least 1")

    root = Path(args.out or tempfile.mkdtemp(prefix="gpu_check-"))
    plain, doctor = [], []
    for trial in range(args.trials):  # alternate which goes first: neither always runs warmer
        order = (False, True) if trial % 2 == 0 else (True, False)
        for doc in order:
            out = root / f"{'doctor' if doc else 'plain'}-{trial}"
            (doctor if doc else plain).append(_launch(args, backend, nproc, out, doctor=doc))
    plain_s, wall_s = statistics.median(plain), statistics.median(doctor)
    ratios = sorted(d / p for p, d in zip(plain, doctor))
    run = load_run([root / f"doctor-{args.trials - 1}" / "run"])
    findings = [f.to_json() for f in diagnose(run).findings]
    dev_s = device_step_s(run)
    failures = [
        msg
        for msg in (
            check_straggler(findings, args.slow),
            check_buckets(run),
            check_step_time(dev_s, doctor[-1]),  # the run the spans came from
            check_fingerprints(run, findings),
        )
        if msg
    ]
    result = {
        "backend": backend,
        "ranks": nproc,
        "gpu": torch.cuda.get_device_name(0),
        "step_ms_plain": round(plain_s * 1e3, 3),
        "step_ms_doctor": round(wall_s * 1e3, 3),
        "step_ms_device_spans": round(dev_s * 1e3, 3),
        "overhead": round(statistics.median(ratios) - 1, 4),
        "overhead_per_trial": [round(r - 1, 4) for r in ratios],
        **fingerprint_cost(torch),
        "failures": failures,
        "out": str(root),
    }
    print(json.dumps(result, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
