"""What the GPU samples show: GPUs shared by ranks, memory on a GPU that is not the rank's own,
GPUs idle during training steps, and the GPU side of a straggler. Pure: reads only the Run."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ddpdoctor.analysis.findings import Finding, detector, rank_list
from ddpdoctor.analysis.slow.gpu import (
    GpuView,
    gpu_view,
    throttle_reasons,
    throttled_share,
)
from ddpdoctor.analysis.slow.phases import training_forwards
from ddpdoctor.trace import schema
from ddpdoctor.trace.merge import TimeBase, time_base
from ddpdoctor.trace.reader import Run

IDLE_UTIL_PCT = 30.0  # mean utilisation during training steps below this: the GPU waits
MIN_SAMPLES = 4  # fewer samples in a window say nothing
CLOCK_RATIO = 0.93  # a straggler's GPU below this share of the others' SM clock runs slower
THROTTLE_SHARE = 0.2  # throttled in at least this share of the straggler's samples
_SET_DEVICE_FIX = (
    "Call torch.cuda.set_device(local_rank) first thing in each rank (before "
    "init_process_group with nccl and any other CUDA call), pass device_ids=[local_rank] to DDP, "
    "load checkpoints with torch.load(..., map_location=f'cuda:{local_rank}') (or 'cpu'), and "
    "never use a bare 'cuda' / .cuda() without the rank's index."
)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


@detector
def shared_gpu(run: Run) -> Iterable[Finding]:
    """Several ranks whose work lands on one GPU."""
    view = gpu_view(run)
    if view is None:
        return
    groups: dict[tuple[str, int], list[int]] = {}
    for rg in view.ranks.values():
        if rg.uses_gpu and rg.gpu is not None:
            groups.setdefault((rg.host, rg.gpu), []).append(rg.rank)
    for (host, index), ranks in sorted(groups.items()):
        if len(ranks) < 2:
            continue
        by = "their processes' memory" if host in view.pid_hosts else "LOCAL_RANK/CUDA_VISIBLE_DEVICES"
        yield Finding(
            "gpu_shared",
            "warning",
            sorted(ranks),
            f"ranks {rank_list(ranks)} all run on GPU {index} of {host} (by {by}): they share its "
            "compute and memory",
            fix="Give each rank its own GPU. " + _SET_DEVICE_FIX + " Check that --nproc_per_node "
            "is not above the GPU count and CUDA_VISIBLE_DEVICES differs per rank if you set it.",
            details={"host": host, "gpu": index, "ranks": sorted(ranks), "by": by},
        )


@detector
def stray_memory(run: Run) -> Iterable[Finding]:
    """Ranks holding memory (a CUDA context at least) on another rank's GPU: usually GPU 0."""
    view = gpu_view(run)
    if view is None:
        return
    strays: dict[tuple[str, int], dict[int, int | None]] = {}
    for rg in view.ranks.values():
        if rg.by != "pid":
            continue
        for index, nbytes in rg.memory.items():
            if index != rg.gpu:
                strays.setdefault((rg.host, index), {})[rg.rank] = nbytes
    for (host, index), ranks in sorted(strays.items()):
        owners = sorted(r for r, g in view.ranks.items() if g.host == host and g.gpu == index)
        sizes = [b for b in ranks.values() if b is not None]
        each = f", {_gib(int(np.median(sizes)))} each" if sizes else ""
        whose = f" (rank {rank_list(owners)}'s GPU)" if owners else ""
        yield Finding(
            "gpu_stray_memory",
            "warning",
            sorted(ranks),
            f"rank(s) {rank_list(ranks)} also hold memory on GPU {index} of {host}{whose}{each}: "
            "a CUDA context or tensors on the default device, from a missing "
            "torch.cuda.set_device(local_rank) or a torch.load without map_location",
            fix=_SET_DEVICE_FIX + " Each stray context takes memory from that GPU (out of memory "
            "on its own rank) and time.",
            details={"host": host, "gpu": index, "bytes": {str(r): b for r, b in sorted(ranks.items())}},
        )
    # Without usable PIDs (a container: the driver reports host PIDs) count processes instead.
    for host in sorted({g.host for g in view.ranks.values()} - view.pid_hosts):
        users = [g for g in view.ranks.values() if g.host == host and g.uses_gpu]
        if len(users) < 2:
            continue
        for dev in (d for d in view.devices if d.host == host):
            expected = [g.rank for g in users if g.expected == dev.index]
            most = max((len(p) for _, p in dev.procs), default=0)
            if expected and most > len(expected):
                others = sorted(g.rank for g in users if g.expected != dev.index)
                yield Finding(
                    "gpu_stray_memory",
                    "warning",
                    others,
                    f"GPU {dev.index} of {host} holds {most} processes but only rank "
                    f"{rank_list(expected)} should run there (the driver's PIDs are not the ranks', "
                    "so which rank left a context there cannot be told): likely a missing "
                    "torch.cuda.set_device(local_rank) or map_location",
                    fix=_SET_DEVICE_FIX,
                    details={"host": host, "gpu": dev.index, "processes": most, "expected": expected},
                )


def _training_window(run: Run, tb: TimeBase, rank: int) -> tuple[float, float] | None:
    trace = run.ranks[rank]
    fwd = training_forwards(trace)
    bwd = trace.kind(schema.BACKWARD)
    if len(fwd) < 2 or not len(bwd):
        return None
    return float(fwd.ts.min() + tb.shift_us[rank]), float(bwd.end.max() + tb.shift_us[rank])


@detector
def idle_gpus(run: Run) -> Iterable[Finding]:
    """GPUs that sat mostly idle while their rank was in training steps."""
    view = gpu_view(run)
    if view is None:
        return
    tb = time_base(run)
    idle: dict[str, dict[str, Any]] = {}
    ranks: list[int] = []
    for dev in view.devices:
        users = [r for r in dev.ranks if view.ranks[r].uses_gpu]
        windows = [w for w in (_training_window(run, tb, r) for r in users) if w]
        if not windows:
            continue
        mask = dev.window(min(a for a, _ in windows), max(b for _, b in windows))
        util = dev.metrics["util"][mask]
        util = util[~np.isnan(util)]
        if len(util) < MIN_SAMPLES or util.mean() >= IDLE_UTIL_PCT:
            continue
        idle[f"{dev.host}:{dev.index}"] = {
            "ranks": users,
            "util_mean_pct": round(float(util.mean()), 1),
            "samples": len(util),
        }
        ranks.extend(users)
    if not idle:
        return
    utils = [v["util_mean_pct"] for v in idle.values()]
    span = f"{min(utils):.0f}%" if len(utils) == 1 else f"{min(utils):.0f}-{max(utils):.0f}%"
    yield Finding(
        "gpu_idle",
        "warning",
        sorted(ranks),
        f"{len(idle)} GPU(s) of rank(s) {rank_list(ranks)} were busy only {span} of the time "
        "during training steps (NVML utilisation): the GPUs wait on the host",
        fix="Find what the step waits for: the data loader (data wait in the table: more "
        "num_workers, pin_memory, prefetch), CPU work or host-device syncs in the step (.item(), "
        ".cpu(), printing tensors), or kernels too small to fill the GPU (a bigger batch, "
        "torch.compile or CUDA graphs).",
        details={"gpus": idle, "threshold_pct": IDLE_UTIL_PCT},
    )


def join_stragglers(run: Run, findings: list[Finding]) -> list[Finding]:
    """Add the GPU evidence to straggler findings: a straggler whose GPU throttles or runs at
    lower SM clocks than the other ranks' GPUs (in place; returns ``findings``)."""
    view = gpu_view(run)
    if view is None:
        return findings
    for f in findings:
        if f.kind not in ("straggler", "straggler_occasional") or len(f.ranks) != 1:
            continue
        evidence = gpu_evidence(view, f.ranks[0])
        if evidence is None:
            continue
        f.details["gpu"] = evidence
        f.summary += f"; its {evidence['text']}"
        gpu_fix = (
            "check cooling and airflow, power limits and clocks "
            "(nvidia-smi -q -d PERFORMANCE,CLOCK,POWER), or move the job off that GPU."
        )
        if f.details.get("phase") in ("forward", "backward", "optimizer"):  # GPU-bound phases
            f.fix = f"Its GPU runs slower: {gpu_fix} {f.fix}"
        else:  # the lateness is elsewhere; the slow GPU is worth knowing but not the cause
            f.fix = f"{f.fix} Its GPU also runs slower than the others': {gpu_fix}"
    return findings


def gpu_evidence(view: GpuView, rank: int) -> dict[str, Any] | None:
    """How the rank's GPU compares with the other ranks' over the run: None if it does not
    throttle more or clock lower."""
    rg = view.ranks.get(rank)
    dev = view.device(rg.host, rg.gpu) if rg else None
    if rg is None or dev is None:
        return None
    others = [d for d in view.devices if d is not dev and d.ranks]
    mask = dev.window(*view.span_us)
    busy = mask & (np.nan_to_num(dev.metrics["util"], nan=100.0) > 0)  # clocks drop when idle
    clock = float(np.nanmean(dev.metrics["sm_clock_mhz"][busy])) if busy.sum() >= MIN_SAMPLES else np.nan
    other_clocks = []
    for d in others:
        m = d.window(*view.span_us) & (np.nan_to_num(d.metrics["util"], nan=100.0) > 0)
        if m.sum() >= MIN_SAMPLES:
            other_clocks.append(float(np.nanmean(d.metrics["sm_clock_mhz"][m])))
    share = throttled_share(dev.throttle[mask]) or 0.0
    reasons = throttle_reasons(dev.throttle[mask])
    typical = float(np.nanmedian(other_clocks)) if other_clocks else np.nan
    slower = bool(np.isfinite(clock) and np.isfinite(typical) and clock < CLOCK_RATIO * typical)
    throttled = share >= THROTTLE_SHARE and bool(reasons)
    if not slower and not throttled:
        return None
    parts = []
    if slower:
        parts.append(f"SM clock averaged {clock:.0f} MHz against {typical:.0f} MHz on the other GPUs")
    if throttled:
        parts.append(f"it was throttled ({', '.join(reasons)}) in {share:.0%} of samples")
    return {
        "host": dev.host,
        "gpu": dev.index,
        "sm_clock_mhz": None if np.isnan(clock) else round(clock, 1),
        "others_sm_clock_mhz": None if np.isnan(typical) else round(typical, 1),
        "throttled_share": share,
        "throttle_reasons": reasons,
        "text": f"GPU {dev.index} ({dev.host}) " + " and ".join(parts),
    }
