"""Run the three bench modes and turn their timings (and the DDP run's trace) into one result.

Each mode runs in a fresh process, one after the other, so they never compete for cores and a
crash in one still leaves the others' numbers. DDP runs under ``supervisor.launch.run_job``
with its own run directory (``<bench dir>/ddp``), so its breakdown is the core probes' and
``ddpdoctor diagnose``/``report``/``compare`` work on it like on any other run.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddpdoctor import _env
from ddpdoctor.bench import worker as worker_module

SCHEMA = "ddpdoctor.bench/1"
WORKER = Path(worker_module.__file__).resolve()
MODES = ("single", "dp", "ddp")


@dataclass
class BenchOptions:
    model: str
    input_shape: tuple[int, ...]
    batch_size: int = 64
    steps: int = 20
    warmup: int = 3
    nproc: int = 2
    loss: str = "cross_entropy"
    modes: tuple[str, ...] = MODES
    threads: int = 0  # per single/dp process; 0: torch's default here
    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything the children print to stderr, so ``--json`` stdout stays one object."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _worker_args(opts: BenchOptions, mode: str, out: Path, threads: int) -> list[str]:
    return [
        str(WORKER),
        f"--mode={mode}",
        f"--model={opts.model}",
        "--input-shape=" + ",".join(map(str, opts.input_shape)),
        f"--batch-size={opts.batch_size}",
        f"--steps={opts.steps}",
        f"--warmup={opts.warmup}",
        f"--loss={opts.loss}",
        f"--threads={threads}",
        f"--out={out}",
    ]


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment (which the launch passes on), restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(WORKER.parent.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.pop("DDPDOCTOR_RUN_DIR", None)  # single/dp are not traced
    return env


def default_threads() -> int:
    import torch

    return torch.get_num_threads()


def run_bench(opts: BenchOptions, run_dir: Path) -> dict[str, Any]:
    """Run every mode; returns the ``ddpdoctor.bench/1`` object (also written to bench.json)."""
    from ddpdoctor.supervisor.launch import WatchOptions, run_job

    results_dir = run_dir / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    threads = opts.threads or default_threads()
    ddp_threads = max(1, threads // opts.nproc)
    modes: dict[str, Any] = {}
    with stdout_to_stderr():
        local = [m for m in ("single", "dp") if m in opts.modes]
        if local:
            proc = subprocess.run(
                [sys.executable, *_worker_args(opts, ",".join(local), results_dir, threads)],
                env=_child_env(),
                stdout=sys.stderr,
                stderr=subprocess.PIPE,
                text=True,
            )
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr)
            for mode in local:  # a mode that wrote its result before a later one failed counts
                found = (results_dir / f"{mode}-rank0.json").is_file()
                modes[mode] = _mode_result(mode, results_dir, 0 if found else proc.returncode or 1, opts)
        if "ddp" in opts.modes:
            ddp_dir = run_dir / "ddp"
            ddp_dir.mkdir(exist_ok=True)
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={opts.nproc}",
                *_worker_args(opts, "ddp", results_dir, ddp_threads),
            ]
            # torchrun would force one thread. The breakdown is the buckets' spans: timed
            # whatever it costs (on the CPU, one more pass over the gradients), unless the
            # user chose otherwise.
            timing = os.environ.get(_env.BUCKET_TIMING) or "on"
            with _environ({"OMP_NUM_THREADS": str(ddp_threads), _env.BUCKET_TIMING: timing}):
                code = run_job(command, ddp_dir, WatchOptions(on_hang="kill")).exit_code
            modes["ddp"] = _mode_result("ddp", results_dir, code, opts)
            modes["ddp"]["run_dir"] = str(ddp_dir)
            modes["ddp"].update(_ddp_from_trace(ddp_dir, opts.warmup))
    _add_scaling(modes)
    result = {
        "schema": SCHEMA,
        "config": {
            "model": opts.model,
            "input_shape": list(opts.input_shape),
            "global_batch": opts.batch_size,
            "steps": opts.steps,
            "warmup": opts.warmup,
            "nproc": opts.nproc,
            "loss": opts.loss,
            "cuda_devices": _cuda_devices(),
            "cpu_count": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
            "torch": _torch_version(),
        },
        "modes": modes,
        "run_dir": str(run_dir),
    }
    from ddpdoctor.bench import explain

    result["notes"] = explain.notes(result)
    return result


def _cuda_devices() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _pcts(values: list[float] | np.ndarray) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    if not len(arr):
        return {"p50": 0.0, "p95": 0.0, "mean": 0.0}
    p50, p95 = np.percentile(arr, [50, 95])
    return {"p50": round(float(p50), 6), "p95": round(float(p95), 6), "mean": round(float(arr.mean()), 6)}


def _mode_result(mode: str, results_dir: Path, exit_code: int, opts: BenchOptions) -> dict[str, Any]:
    """One mode's numbers from its processes' result files. A step's time is the slowest
    process's: the all-reduce makes every DDP rank wait for the last one anyway."""
    files = sorted(results_dir.glob(f"{mode}-rank*.json"))
    ranks = []
    for path in files:
        try:
            ranks.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    if exit_code != 0 or not ranks:
        return {"ok": False, "exit_code": exit_code, "steps": 0, "samples_per_s": 0.0, "step_time_p50_s": 0.0}
    n = min(len(r["step_s"]) for r in ranks)
    step = np.max([np.asarray(r["step_s"][:n]) for r in ranks], axis=0)
    pct = _pcts(step)
    first = ranks[0]
    breakdown = {
        name: _pcts(np.mean([np.asarray(r["phases"][name][:n]) for r in ranks], axis=0))["mean"]
        for name in first["phases"]
    }
    memory: dict[str, int] = {}
    for r in ranks:
        memory.update(r.get("memory_bytes", {}))
    total = float(step.sum())
    return {
        "ok": True,
        "exit_code": exit_code,
        "steps": int(n),
        "world_size": int(first["world_size"]),
        "replicas": int(first["replicas"]),
        "device": first["device"],
        "devices": first["devices"],
        "threads_per_process": int(first["threads"]),
        "batch_per_process": int(first["batch_per_process"]),
        "samples_per_s": round(opts.batch_size * n / total, 3) if total > 0 else 0.0,
        "step_time_p50_s": pct["p50"],
        "step_time_p95_s": pct["p95"],
        "step_time_mean_s": pct["mean"],
        "step_times_s": [round(float(s), 6) for s in step],
        "breakdown_s": breakdown,
        "memory_per_gpu_bytes": memory or None,
        "params": int(first["params"]),
    }


def _add_scaling(modes: dict[str, Any]) -> None:
    """Speedup over the single process, and efficiency = speedup / workers (strong scaling:
    the same global batch, so N workers at best make a step N times faster)."""
    base = modes.get("single", {}).get("samples_per_s") or 0.0
    for name, mode in modes.items():
        if not mode.get("ok") or not base:
            mode["speedup"] = mode["scaling_efficiency"] = None
            continue
        workers = mode["world_size"] if name == "ddp" else mode["replicas"]
        mode["speedup"] = round(mode["samples_per_s"] / base, 4)
        mode["scaling_efficiency"] = round(mode["speedup"] / max(1, workers), 4)


def _ddp_from_trace(ddp_dir: Path, warmup: int) -> dict[str, Any]:
    """DDP's forward, backward, all-reduce and overlap as the core probes saw them, warm-up
    steps left out, and what `diagnose` found."""
    from ddpdoctor.analysis import diagnose
    from ddpdoctor.trace.reader import TraceError, load_run

    try:
        diag = diagnose(load_run([ddp_dir]))
    except TraceError as exc:
        return {"probes": None, "probe_note": str(exc), "findings": []}
    return {
        "probes": probe_breakdown(diag.run, warmup),
        "findings": [f.to_json() for f in diag.findings],
        "ddp": {k: diag.ddp.get(k) for k in ("module", "params", "param_bytes", "buckets") if k in diag.ddp},
    }


def probe_breakdown(run: Any, warmup: int) -> dict[str, Any]:
    """Per-step means (s) over ranks and steps >= ``warmup``: forward, backward, the bucket
    all-reduces (summed), their exposed part (after the last bucket was ready, until backward
    returned: time nothing else could run) and overlap = 1 - exposed / all-reduce span."""
    from ddpdoctor.analysis.slow.phases import training_forwards
    from ddpdoctor.trace import schema

    fwd_s, bwd_s, ar_s, exposed_s, overlap, nbytes = [], [], [], [], [], []
    for trace in run.ranks.values():
        fwd = training_forwards(trace)
        keep = fwd.step >= warmup
        fwd_s.extend((fwd.dur[keep] / 1e6).tolist())
        bwd = trace.kind(schema.BACKWARD)
        ar = trace.kind(schema.ALLREDUCE)
        bwd_end = {int(s): int(e) for s, e in zip(bwd.step.tolist(), bwd.end.tolist())}
        bwd_s.extend((bwd.dur[bwd.step >= warmup] / 1e6).tolist())
        for step in sorted(set(ar.step.tolist())):
            if step < warmup or step not in bwd_end:
                continue
            sel = ar.step == step
            ready, end = ar.ts[sel], ar.end[sel]
            span = float(end.max() - ready.min())
            exposed = float(max(0, bwd_end[step] - int(ready.max())))
            ar_s.append(float(ar.dur[sel].sum()) / 1e6)
            exposed_s.append(exposed / 1e6)
            overlap.append(1.0 - min(1.0, exposed / span) if span > 0 else 0.0)
            nbytes.append(sum(int(f[1]) for f, k in zip(ar.fields, sel) if k and len(f) > 1))

    def mean(values: list[float]) -> float | None:
        return round(float(np.mean(values)), 6) if values else None

    return {
        "forward_s": mean(fwd_s),
        "backward_s": mean(bwd_s),
        "allreduce_s": mean(ar_s),
        "exposed_allreduce_s": mean(exposed_s),
        "overlap": round(float(np.mean(overlap)), 4) if overlap else None,
        "allreduce_bytes_per_step": int(np.mean(nbytes)) if nbytes else None,
        "steps": len(ar_s) // max(1, len(run.ranks)),
    }
