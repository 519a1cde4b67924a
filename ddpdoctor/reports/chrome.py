"""Chrome trace JSON (``ddpdoctor export``) for ui.perfetto.dev and chrome://tracing.

One process per rank, named ``rank N (host)``; its events go on a compute thread, its
bucket all-reduces and buffer broadcasts on a comm thread, and its device spans (CUDA events,
when the model was on a GPU) on a gpu thread. Complete events ("X") must nest on
a thread, and a rank's bucket all-reduces overlap one another, so an event that would break
nesting moves to the next thread of its kind ("comm 2", ...) instead. Timestamps are µs on the
run's common time base (every rank aligned to rank 0's clock). GPU metrics, when the trace
holds ``gpu`` records, become counter ("C") events; the supervisor's NVML samples
(``gpu-<host>.jsonl``) become one process per GPU, sorted under the ranks, holding counters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ddpdoctor.analysis import Diagnosis
from ddpdoctor.rundir import write_atomic
from ddpdoctor.trace import schema
from ddpdoctor.trace.merge import time_base
from ddpdoctor.trace.reader import RankTrace

GPU_KIND = "gpu"  # metadata records {name: number, ...} sampled by the NVML probe, when present
COMPUTE_KINDS = (
    schema.DDP_INIT,
    schema.DATA_WAIT,
    schema.FORWARD,
    schema.BACKWARD,
    schema.OPTIMIZER,
    schema.COLLECTIVE,
)
COMM_KINDS = (schema.ALLREDUCE, schema.SYNC_BUFFERS)
DEVICE_KINDS = tuple(schema.DEVICE_KINDS.values())  # CUDA-event spans: a "gpu" thread
COMPUTE_TID, COMM_TID, DEVICE_TID = 1, 100, 200  # extra lanes count up from these
_CPU_TWIN = {dev: cpu for cpu, dev in schema.DEVICE_KINDS.items()}


def _args(kind: str, step: int, fields: tuple, buckets: dict[int, list[str]]) -> tuple[str, dict]:
    """(event name, args) from a record's fields."""
    args: dict[str, Any] = {"step": step}
    kind = _CPU_TWIN.get(kind, kind)  # a device span is named as its CPU twin
    name = kind
    if kind == schema.ALLREDUCE and len(fields) >= 2:
        name = f"allreduce bucket {fields[0]}"
        args.update(bucket=fields[0], bytes=fields[1])
        if fields[0] in buckets:
            args["params"] = buckets[fields[0]]
    elif kind == schema.COLLECTIVE and fields:
        name = str(fields[0])
        keys = ("op", "bytes", "group", "group_size", "seq", "async")
        args.update(dict(zip(keys, fields, strict=False)))
    elif kind == schema.FORWARD and fields:
        name = "forward" if fields[0] == 1 else "forward (no grad)"
    elif kind == schema.OPTIMIZER and fields:
        name = f"optimizer {fields[0]}"
    elif kind == schema.DDP_INIT and fields and isinstance(fields[0], dict):
        args.update({k: v for k, v in fields[0].items() if k != "buckets"})
    return name, args


def _lanes(events: list[tuple[int, int, str, dict]], base_tid: int) -> Iterator[tuple[int, tuple]]:
    """Assign each (ts, dur, name, args) a thread on which X events nest properly."""
    stacks: list[list[int]] = []  # per lane: end times of the open events
    for ev in sorted(events, key=lambda e: (e[0], -e[1])):
        ts, dur = ev[0], ev[1]
        end = ts + dur
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= ts:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                yield base_tid + lane, ev
                break
        else:
            stacks.append([end])
            yield base_tid + len(stacks) - 1, ev


def _bucket_params(trace: RankTrace) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for _ts, _step, info in trace.meta.get(schema.BUCKET, []):
        if isinstance(info.get("index"), int):
            out[info["index"]] = [str(p) for p in info.get("params", [])]
    return out


def trace_events(diag: Diagnosis) -> list[dict[str, Any]]:
    """The ``traceEvents`` list for a diagnosed run."""
    run = diag.run
    tb = time_base(run)
    out: list[dict[str, Any]] = []
    for rank, trace in sorted(run.ranks.items()):
        pid = rank
        out.append(
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {rank} ({trace.host})"}}
        )
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": rank}})
        buckets = _bucket_params(trace)
        lanes = ((COMPUTE_KINDS, COMPUTE_TID, "compute"), (COMM_KINDS, COMM_TID, "comm"))
        for kinds, base, label in (*lanes, (DEVICE_KINDS, DEVICE_TID, "gpu")):
            events: list[tuple[int, int, str, dict]] = []
            for kind in kinds:
                ev = trace.kind(kind)
                if not len(ev):
                    continue
                ts = tb.rel(rank, ev.ts)
                for t, d, s, f in zip(ts.tolist(), ev.dur.tolist(), ev.step.tolist(), ev.fields, strict=True):
                    name, args = _args(kind, s, f, buckets)
                    events.append((t, max(d, 0), name, dict(args, cat=kind)))
            used: set[int] = set()
            for tid, (t, d, name, args) in _lanes(events, base):
                used.add(tid)
                cat = args.pop("cat")
                out.append(
                    {
                        "name": name,
                        "cat": cat,
                        "ph": "X",
                        "ts": t,
                        "dur": d,
                        "pid": pid,
                        "tid": tid,
                        "args": args,
                    }
                )
            if base == COMM_TID:
                used.add(COMM_TID)  # always name the comm thread, even when empty
            for tid in sorted(used):
                extra = tid - base
                tname = label if extra == 0 else f"{label} {extra + 1}"
                out.append(
                    {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": tname}}
                )
                out.append(
                    {
                        "name": "thread_sort_index",
                        "ph": "M",
                        "pid": pid,
                        "tid": tid,
                        "args": {"sort_index": tid},
                    }
                )
        for ts, _step, info in trace.meta.get(GPU_KIND, []):
            values = {
                k: v for k, v in info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            if values:
                t = int(tb.rel(rank, np.asarray([ts]))[0])
                out.append({"name": "gpu", "ph": "C", "ts": t, "pid": pid, "args": values})
    return out


GPU_PID_BASE = 1_000_000  # GPU processes come after every rank's
# counter name -> (metric, series name, scale)
GPU_COUNTERS: dict[str, list[tuple[str, str, float]]] = {
    "utilization %": [("util", "gpu", 1.0), ("mem_util", "memory", 1.0)],
    "memory used GiB": [("mem_used", "used", 2.0**-30)],
    "power W": [("power_w", "power", 1.0)],
    "SM clock MHz": [("sm_clock_mhz", "sm", 1.0)],
    "temperature C": [("temp_c", "gpu", 1.0)],
}


def gpu_events(diag: Diagnosis) -> list[dict[str, Any]]:
    """One process per sampled GPU with its NVML metrics as counters, on the common base."""
    from ddpdoctor.analysis.gpu import SLOWDOWN_MASK

    view = diag.gpus
    out: list[dict[str, Any]] = []
    for k, dev in enumerate(view.devices if view is not None else []):
        pid = GPU_PID_BASE + k
        ranks = f" ranks {','.join(map(str, dev.ranks))}" if dev.ranks else ""
        name = f"{dev.label}{ranks}"
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        keep = dev.t_us >= 0  # samples before the first rank event only stretch the view
        for i in np.flatnonzero(keep).tolist():
            ts = int(dev.t_us[i])
            for counter, series in GPU_COUNTERS.items():
                args = {
                    label: round(float(dev.metrics[metric][i]) * scale, 3)
                    for metric, label, scale in series
                    if not np.isnan(dev.metrics[metric][i])
                }
                if args:
                    out.append({"name": counter, "ph": "C", "ts": ts, "pid": pid, "args": args})
            if dev.throttle[i] >= 0:
                slow = int((int(dev.throttle[i]) & SLOWDOWN_MASK) != 0)
                out.append({"name": "throttled", "ph": "C", "ts": ts, "pid": pid, "args": {"slowdown": slow}})
    return out


def render(diag: Diagnosis) -> dict[str, Any]:
    return {
        "traceEvents": trace_events(diag) + gpu_events(diag),
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "ddpdoctor",
            "world_size": diag.run.world_size,
            "command": diag.run.command,
        },
    }


def write(diag: Diagnosis, path: str | os.PathLike[str]) -> Path:
    """Write the trace atomically (temporary name, then rename)."""
    return write_atomic(path, json.dumps(render(diag), separators=(",", ":")))
