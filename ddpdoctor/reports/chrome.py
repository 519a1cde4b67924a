"""Chrome trace JSON (``ddpdoctor export``) for ui.perfetto.dev and chrome://tracing.

One process per rank, named ``rank N (host)``; its events go on a compute thread and its
bucket all-reduces and buffer broadcasts on a comm thread; spans timed on the device (CUDA
events, when the model was on a GPU) go on a gpu thread and a gpu comm thread. Complete events
("X") must nest on a thread, and a rank's bucket all-reduces overlap one another, so an event that would break
nesting moves to the next thread of its kind ("comm 2", ...) instead. Timestamps are µs on the
run's common time base (every rank aligned to rank 0's clock). Which kinds go on which thread,
and their names and args, come from the vocabulary (``schema.KINDS`` and ``schema.PHASES``).
The supervisor's NVML samples (``gpu-<host>.jsonl``) become one process per GPU, sorted under
the ranks, holding counters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from ddpdoctor.analysis import Diagnosis
from ddpdoctor.analysis.failed.failure import FailureView
from ddpdoctor.trace import schema

COMPUTE_TID, COMM_TID, DEVICE_TID, DEVICE_COMM_TID = 1, 100, 200, 300  # extra lanes count up


def _kinds(lane: schema.Lane) -> list[str]:
    """The span kinds drawn on one lane (a kind of several phases is drawn once)."""
    return list(dict.fromkeys(p.kind for p in schema.PHASES.values() if p.lane == lane))


def _args(kind: str, step: int, fields: tuple, buckets: dict[int, list[str]]) -> tuple[str, dict]:
    """(event name, args) from a record's fields, named as the vocabulary declares them."""
    declared = schema.KINDS[kind]
    args: dict[str, Any] = {"step": step}
    for key, value in declared.args(fields).items():
        if isinstance(value, dict):  # DDP init's description: its keys, without the bucket list
            args.update({k: v for k, v in value.items() if k != "buckets"})
        else:
            args[key] = value
    if args.get("bucket") in buckets:
        args["params"] = buckets[args["bucket"]]
    return declared.describe(fields), args


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


def trace_events(diag: Diagnosis) -> list[dict[str, Any]]:
    """The ``traceEvents`` list for a diagnosed run."""
    run, tb = diag.run, diag.time_base
    assert tb is not None
    buckets = {i: [str(p) for p in info.get("params", [])] for i, info in diag.bucket_layout.items()}
    view = diag.failure
    hidden = view.hidden() if view is not None else set()  # exported as open spans instead
    out: list[dict[str, Any]] = []
    for rank, trace in sorted(run.ranks.items()):
        pid = rank
        out.append(
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {rank} ({trace.host})"}}
        )
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": rank}})
        lanes = (
            (schema.Lane.COMPUTE, COMPUTE_TID, "compute"),
            (schema.Lane.COMM, COMM_TID, "comm"),
            (schema.Lane.DEVICE, DEVICE_TID, "gpu"),  # device spans (CUDA events), when recorded
            (schema.Lane.DEVICE_COMM, DEVICE_COMM_TID, "gpu comm"),
        )
        for lane, base, label in lanes:
            kinds = _kinds(lane)
            events: list[tuple[int, int, str, dict]] = []
            for kind in kinds:
                ev = trace.kind(kind)
                if not len(ev):
                    continue
                ts = tb.rel(rank, ev.ts)
                rows = zip(
                    ts.tolist(), ev.ts.tolist(), ev.dur.tolist(), ev.step.tolist(), ev.fields, strict=True
                )
                for t, raw, d, s, f in rows:
                    if hidden and (rank, kind, raw) in hidden:
                        continue
                    name, args = _args(kind, s, f, buckets)
                    events.append((t, max(d, 0), name, dict(args, cat=kind)))
            events.extend(_open_spans(view, rank, lane))
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
    return out + _instants(view)


def _open_spans(view: FailureView | None, rank: int, lane: schema.Lane) -> list[tuple[int, int, str, dict]]:
    """The spans this rank entered and never left, as complete events up to its record's end."""
    out: list[tuple[int, int, str, dict]] = []
    for span in view.open_spans if view is not None else []:
        if span.rank != rank or span.lane != lane:
            continue
        args: dict[str, Any] = {"did_not_finish": True, "step": span.step, "ended_by": span.ended_by}
        args.update(
            {k: v for k, v in (("op", span.op), ("seq", span.seq), ("user_frame", span.user_frame)) if v}
        )
        start = round(span.start_s * 1e6)
        name = f"{span.label} ({schema.DID_NOT_FINISH})"
        out.append((start, max(round(span.end_s * 1e6) - start, 0), name, dict(args, cat=span.kind)))
    return out


def _instants(view: FailureView | None) -> list[dict[str, Any]]:
    """The moments (hang verdict, kill, first death) across the trace, and each failed rank's end."""
    if view is None:
        return []
    out: list[dict[str, Any]] = [
        {"name": m.label, "cat": m.kind, "ph": "i", "s": "g", "ts": round(m.time_s * 1e6), "pid": 0, "tid": 0}
        for m in view.markers
    ]
    for end in sorted(view.ranks.values(), key=lambda e: e.rank):
        if end.failed:
            out.append(
                {
                    "name": f"rank {end.rank} {end.how_text}",
                    "cat": "rank_end",
                    "ph": "i",
                    "s": "p",
                    "ts": round(end.end_s * 1e6),
                    "pid": end.rank,
                    "tid": COMPUTE_TID,
                    "args": {"how": end.how, "step": end.step, "step_text": end.step_text},
                }
            )
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
    from ddpdoctor.analysis.slow.gpu import SLOWDOWN_MASK

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


def document(diag: Diagnosis) -> dict[str, Any]:
    return {
        "traceEvents": trace_events(diag) + gpu_events(diag),
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "ddpdoctor",
            "world_size": diag.run.world_size,
            "command": diag.run.command,
        },
    }


def render(diag: Diagnosis) -> str:
    """The trace as compact JSON text."""
    return json.dumps(document(diag), separators=(",", ":"))
