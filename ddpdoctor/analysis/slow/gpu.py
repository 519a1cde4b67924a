"""GPU use from the supervisor's NVML samples, on the ranks' time base (findings: gpu_findings.py).

Alignment: a node's sampler anchors its monotonic clock (header ``mono_ns``) as its ranks do,
and ranks on one host share that clock, so a sample's place on the run's common base is its
``mono`` minus a host rank's ``mono_ns`` plus that rank's shift (``trace/merge.py``); only a
node without ranks falls back to its wall clock.

Which rank runs on which GPU: by PID where the driver's PIDs are the ranks' own (the rank's
process holds memory there), else (containers report host PIDs) by LOCAL_RANK and
CUDA_VISIBLE_DEVICES from the rank's trace header.

Pure: reads only the Run (no pynvml, no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.trace.merge import TimeBase, time_base
from ddpdoctor.trace.reader import GpuTrace, Run

METRICS = ("util", "mem_util", "mem_used", "power_w", "sm_clock_mhz", "temp_c")
# NVML clock event reasons that slow a busy GPU down (idle, application clocks, sync boost and
# display clocks do not).
SLOWDOWN_BITS = {
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
}
SLOWDOWN_MASK = sum(SLOWDOWN_BITS)


@dataclass
class Device:
    """One GPU's samples on the run's common base."""

    host: str
    index: int
    info: dict[str, Any]  # the header's static facts: name, uuid, mem_total, max clock...
    t_us: np.ndarray  # sample times, µs since the run's time zero
    metrics: dict[str, np.ndarray]  # float, NaN where a sample lacks the metric
    throttle: np.ndarray  # int64 clock event reason bits, -1 where unknown
    procs: list[tuple[int, list[list[Any]]]]  # (t_us, [[pid, bytes or None]...])
    ranks: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.host})"

    def window(self, lo: float, hi: float) -> np.ndarray:
        return (self.t_us >= lo) & (self.t_us <= hi)


@dataclass
class RankGpu:
    """Where one rank's GPU work went."""

    rank: int
    host: str
    gpu: int | None  # the GPU it mainly uses (most memory), or the one it should use
    by: str  # "pid": seen in the driver's process list; "local_rank": inferred; "none"
    uses_gpu: bool  # evidence it runs on a GPU at all (memory seen, or the nccl backend)
    memory: dict[int, int | None] = field(default_factory=dict)  # gpu -> peak bytes (by PID)
    expected: int | None = None  # from LOCAL_RANK and CUDA_VISIBLE_DEVICES


@dataclass
class GpuView:
    """Everything the NVML samples say about a run."""

    devices: list[Device]
    ranks: dict[int, RankGpu]
    missing: str | None  # one line: what NVML could not give (None: nothing missing)
    span_us: tuple[float, float]  # the ranks' recorded span on the common base
    pid_hosts: set[str] = field(default_factory=set)  # hosts where PIDs matched ranks

    def device(self, host: str, index: int | None) -> Device | None:
        return next((d for d in self.devices if d.host == host and d.index == index), None)


# ---------------------------------------------------------------------------------------------
# Building the view


def gpu_view(run: Run, tb: TimeBase | None = None) -> GpuView | None:
    """The run's GPU samples aligned and mapped to ranks; None when no node sampled GPUs."""
    if "gpu_view" in run.derived:
        return run.derived["gpu_view"]
    if not run.gpus:
        run.derived["gpu_view"] = None
        return None
    tb = tb or time_base(run)
    devices: list[Device] = []
    for g in run.gpus:
        devices.extend(_devices(g, _shift_us(run, tb, g)))
    ends = [tb.shift_us[r] + t.last_ts for r, t in run.ranks.items()]
    span = (0.0, float(max(ends, default=0)))
    view = GpuView(devices, {}, missing_text(run.gpus), span)
    _map_ranks(run, view)
    run.derived["gpu_view"] = view
    return view


def _shift_us(run: Run, tb: TimeBase, g: GpuTrace) -> int:
    """Add to the sampler's timestamps to get µs on the run's common base."""
    mono = g.header.get("mono_ns")
    for rank, trace in sorted(run.ranks.items()):
        if trace.host == g.host and isinstance(mono, int) and isinstance(trace.header.get("mono_ns"), int):
            return (mono - int(trace.header["mono_ns"])) // 1000 + tb.shift_us[rank]
    return int(g.header.get("wall_ns", 0)) // 1000 - tb.origin_us


def _devices(g: GpuTrace, shift: int) -> list[Device]:
    infos = {int(i["index"]): i for i in g.header.get("gpus", []) if isinstance(i.get("index"), int)}
    indices = sorted(set(infos) | {int(rec["gpu"]) for _, rec in g.samples})
    out = []
    for index in indices:
        recs = [(ts, rec) for ts, rec in g.samples if rec["gpu"] == index]
        t = np.array([ts + shift for ts, _ in recs], dtype=np.float64)
        metrics = {m: np.array([_num(rec.get(m)) for _, rec in recs], dtype=np.float64) for m in METRICS}
        throttle = np.array(
            [rec["throttle"] if isinstance(rec.get("throttle"), int) else -1 for _, rec in recs], np.int64
        )
        procs = [(ts + shift, list(rec.get("procs") or [])) for ts, rec in g.procs if rec["gpu"] == index]
        info = dict(infos.get(index, {}))
        if "mem_total" not in info:
            totals = [rec["mem_total"] for _, rec in recs if isinstance(rec.get("mem_total"), int)]
            if totals:
                info["mem_total"] = totals[-1]
        out.append(Device(g.host, index, info, t, metrics, throttle, procs))
    return out


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else np.nan


def expected_gpu(header: dict[str, Any], gpus: list[dict[str, Any]]) -> int | None:
    """The NVML index a rank should use: CUDA_VISIBLE_DEVICES[LOCAL_RANK] (the only visible
    one when each rank sees one), else LOCAL_RANK itself; None when it cannot be told."""
    local = header.get("local_rank")
    if not isinstance(local, int):
        return None
    count = len(gpus)
    cvd = header.get("cuda_visible_devices")
    if cvd is None or not str(cvd).strip():
        return local if local < count else None
    items = [x.strip() for x in str(cvd).split(",") if x.strip()]
    if not items:
        return None
    item = items[0] if len(items) == 1 else (items[local] if local < len(items) else None)
    if item is None:
        return None
    if item.isdigit():
        return int(item)
    for g in gpus:  # a UUID (or a unique prefix of one)
        if str(g.get("uuid", "")).startswith(item) and isinstance(g.get("index"), int):
            return int(g["index"])
    return None


def _map_ranks(run: Run, view: GpuView) -> None:
    headers = {g.host: g.header.get("gpus", []) for g in run.gpus}
    sampled = {host for host, gpus in headers.items() if gpus}
    for rank, trace in sorted(run.ranks.items()):
        if trace.host not in sampled:
            continue
        expected = expected_gpu(trace.header, headers[trace.host])
        rg = RankGpu(rank, trace.host, expected, "local_rank" if expected is not None else "none", False)
        rg.expected = expected
        pid = trace.header.get("pid")
        for dev in view.devices:
            if dev.host != trace.host:
                continue
            for _t, procs in dev.procs:
                for p in procs:
                    if len(p) >= 2 and p[0] == pid:
                        old = rg.memory.get(dev.index)
                        new = p[1] if isinstance(p[1], int) else None
                        rg.memory[dev.index] = max(old or 0, new or 0) if (old or new) else None
        if rg.memory:
            rg.by, rg.uses_gpu = "pid", True
            rg.gpu = max(sorted(rg.memory), key=lambda i: rg.memory[i] or 0)
            view.pid_hosts.add(trace.host)
        else:
            dev = view.device(trace.host, expected)
            rg.uses_gpu = trace.header.get("backend") == "nccl" or bool(dev and any(p for _, p in dev.procs))
        view.ranks[rank] = rg
    for rg in view.ranks.values():
        dev = view.device(rg.host, rg.gpu)
        if dev is not None and rg.uses_gpu:
            dev.ranks.append(rg.rank)


# ---------------------------------------------------------------------------------------------
# What is missing (one line)


def missing_text(gpus: list[GpuTrace]) -> str | None:
    """What NVML could not give, in one line; None when every node sampled every metric."""
    parts: list[str] = []
    many = len({g.host for g in gpus}) > 1  # two launchers on one host share its GPUs' story
    for g in gpus:
        where = f" on {g.host}" if many else ""
        unavailable = g.meta.get("unavailable")
        if unavailable:
            info = unavailable[0][1]
            parts.append(f"no GPU metrics{where}: {info.get('reason') or info.get('error')}")
            continue
        unsupported: dict[str, list[int]] = {}
        for _ts, info in g.meta.get("unsupported", []):
            unsupported.setdefault(str(info.get("metric")), []).append(int(info.get("gpu", -1)))
        if unsupported:
            shown = ", ".join(f"{m} (GPU {rank_list(i)})" for m, i in sorted(unsupported.items()))
            parts.append(f"not available from NVML{where}: {shown}")
        for kind in ("nvml_error", "sampler_error"):
            for ts, info in g.meta.get(kind, [])[:1]:
                what = f" reading {info['metric']} of GPU {info.get('gpu')}" if info.get("metric") else ""
                parts.append(f"GPU sampling stopped{where} after {ts / 1e6:.1f} s: {info.get('error')}{what}")
    return "; ".join(dict.fromkeys(parts)) or None


# ---------------------------------------------------------------------------------------------
# Statistics


def _mean_peak(values: np.ndarray, digits: int = 1) -> dict[str, float] | None:
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    return {"mean": round(float(values.mean()), digits), "peak": round(float(values.max()), digits)}


def throttle_reasons(bits: np.ndarray) -> list[str]:
    seen = int(np.bitwise_or.reduce(bits[bits >= 0])) if (bits >= 0).any() else 0
    return [name for bit, name in SLOWDOWN_BITS.items() if seen & bit]


def throttled_share(bits: np.ndarray) -> float | None:
    known = bits[bits >= 0]
    return round(float(((known & SLOWDOWN_MASK) != 0).mean()), 3) if len(known) else None


def device_stats(view: GpuView, dev: Device) -> dict[str, Any]:
    """Mean and peak of each metric over the ranks' recorded span (all samples if none in it)."""
    mask = dev.window(*view.span_us)
    if mask.sum() < 1:
        mask = np.ones(len(dev.t_us), bool)
    out: dict[str, Any] = {
        "host": dev.host,
        "index": dev.index,
        "name": dev.info.get("name"),
        "uuid": dev.info.get("uuid"),
        "ranks": sorted(dev.ranks),
        "mapped_by": sorted({view.ranks[r].by for r in dev.ranks}),
        "samples": int(mask.sum()),
        "mem_total_bytes": dev.info.get("mem_total"),
    }
    names = {
        "util": "util_pct",
        "mem_util": "mem_util_pct",
        "mem_used": "mem_used_bytes",
        "power_w": "power_w",
        "sm_clock_mhz": "sm_clock_mhz",
        "temp_c": "temp_c",
    }
    for metric, key in names.items():
        out[key] = _mean_peak(dev.metrics[metric][mask], 0 if metric == "mem_used" else 1)
    out["throttled_share"] = throttled_share(dev.throttle[mask])
    out["throttle_reasons"] = throttle_reasons(dev.throttle[mask])
    return out


def summary(view: GpuView | None) -> dict[str, Any]:
    """The ``gpus`` object of ``diagnose --json``."""
    if view is None:
        return {"sampled": False, "missing": None, "devices": [], "ranks": {}}
    return {
        "sampled": True,
        "missing": view.missing,
        "devices": [device_stats(view, d) for d in view.devices],
        "ranks": {
            str(r): {
                "host": g.host,
                "gpu": g.gpu,
                "by": g.by,
                "uses_gpu": g.uses_gpu,
                "expected_gpu": g.expected,
                "memory_bytes": {str(i): b for i, b in sorted(g.memory.items())},
            }
            for r, g in sorted(view.ranks.items())
        },
    }
