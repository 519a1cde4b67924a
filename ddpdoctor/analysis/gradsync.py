"""Gradient sync quality: per bucket size, names, arrival skew, transfer time, overlap.

Per step and bucket, like the straggler analysis, without cross-host clocks: the all-reduce
ends at about the same moment on every rank, so the shortest wait (the last rank to arrive)
is the transfer itself, and the spread of waits is the arrival skew. Communication that
overlaps the backward is free; what runs after the last gradient is computed is exposed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ddpdoctor.analysis.findings import Finding, detector
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run

EXPOSED_SHARE = 0.25  # of the step time: exposed communication worth a finding
BIG_BUCKET = 8 * 2**20  # one bucket this large could have been several overlapping ones


def bucket_layout(run: Run) -> dict[int, dict[str, Any]]:
    """The latest layout of each bucket (DDP rebuilds buckets after the first step)."""
    for _, trace in sorted(run.ranks.items()):
        layout = {int(info["index"]): info for _, _, info in trace.meta.get(schema.BUCKET, [])}
        if layout:
            return layout
    return {}


def _waits(run: Run) -> tuple[np.ndarray, list[int], list[int]] | None:
    """(ranks, steps, buckets) all-reduce durations in µs over steps every rank completed."""
    per_rank: dict[int, dict[tuple[int, int], int]] = {}
    for rank, trace in sorted(run.ranks.items()):
        ar = trace.kind(schema.ALLREDUCE)
        per_rank[rank] = {
            (step, int(f[0]) if f else 0): dur
            for step, dur, f in zip(ar.step.tolist(), ar.dur.tolist(), ar.fields)
        }
    if len(per_rank) < 2 or not all(per_rank.values()):
        return None
    keys = set.intersection(*(set(d) for d in per_rank.values()))
    steps = sorted({s for s, _ in keys})
    buckets = sorted({b for _, b in keys})
    if not steps:
        return None
    waits = np.full((len(per_rank), len(steps), len(buckets)), np.nan)
    for i, d in enumerate(per_rank.values()):
        for (s, b), dur in d.items():
            if (s, b) in keys:
                waits[i, steps.index(s), buckets.index(b)] = dur
    return waits, steps, buckets


def exposed_comm_us(run: Run) -> tuple[float, float]:
    """(median µs per step that the backward waits after its last bucket is ready, median step µs).

    Taken on the rank that arrives last at each step: earlier ranks also wait for it, which
    is skew (a straggler), not communication.
    """
    per_rank: list[dict[int, int]] = []
    periods: list[float] = []
    for trace in run.ranks.values():
        ar, bwd = trace.kind(schema.ALLREDUCE), trace.kind(schema.BACKWARD)
        last_ready: dict[int, int] = {}
        for step, ts in zip(ar.step.tolist(), ar.ts.tolist()):
            last_ready[step] = max(ts, last_ready.get(step, ts))
        per_rank.append(
            {
                step: max(0, end - last_ready[step])
                for step, end in zip(bwd.step.tolist(), bwd.end.tolist())
                if step in last_ready
            }
        )
        if len(bwd) > 1:
            periods.extend(np.diff(np.sort(bwd.end)).tolist())
    common = set.intersection(*(set(d) for d in per_rank)) if per_rank else set()
    common.discard(0)  # step 0 reduces in the constructor's bucket layout
    if not common or not periods:
        return 0.0, 0.0
    exposed = [min(d[s] for d in per_rank) for s in common]
    return float(np.median(exposed)), float(np.median(periods))


def bucket_stats(run: Run) -> list[dict[str, Any]]:
    """One row per bucket: bytes, parameters, median reduce time, transfer and arrival skew."""
    layout = bucket_layout(run)
    found = _waits(run)
    rows = []
    if found is None:
        return rows
    waits, _, buckets = found
    for j, b in enumerate(buckets):
        w = waits[:, 1:, j] if waits.shape[1] > 1 else waits[:, :, j]  # skip step 0's layout
        info = layout.get(b, {})
        skew = np.nanmax(w, axis=0) - np.nanmin(w, axis=0)
        rows.append(
            {
                "index": b,
                "bytes": info.get("bytes"),
                "params": info.get("params", []),
                "reduce_ms_p50": round(float(np.nanmedian(w)) / 1e3, 3),
                "transfer_ms_p50": round(float(np.nanmedian(np.nanmin(w, axis=0))) / 1e3, 3),
                "arrival_skew_ms_p50": round(float(np.nanmedian(skew)) / 1e3, 3),
            }
        )
    return rows


@detector
def comm_not_overlapped(run: Run) -> Iterable[Finding]:
    exposed, step = exposed_comm_us(run)
    if not step or exposed < EXPOSED_SHARE * step:
        return
    layout = bucket_layout(run)
    opts = {}
    for trace in run.ranks.values():
        init = trace.kind(schema.DDP_INIT)
        if len(init):
            opts = init.fields[-1][0].get("options", {})
            break
    share = exposed / step
    biggest = max((info.get("bytes", 0) for info in layout.values()), default=0)
    total = sum(info.get("bytes", 0) for info in layout.values())
    details = {
        "exposed_ms_per_step": round(exposed / 1e3, 3),
        "step_ms": round(step / 1e3, 3),
        "share": round(share, 3),
        "buckets": len(layout),
        "gradient_bytes": total,
        "bucket_bytes_max": biggest,
        "bucket_cap_mb": opts.get("bucket_cap_mb"),
    }
    waiting = (
        f"{exposed / 1e3:.1f} ms of every {step / 1e3:.1f} ms step ({share:.0%}) waits for the "
        "gradient all-reduce after the last gradient is computed"
    )
    if len(layout) == 1 and total >= BIG_BUCKET:
        yield Finding(
            "comm_not_overlapped",
            "warning",
            sorted(run.ranks),
            f"{waiting}: all {total / 2**20:.1f} MB of gradients sit in one bucket, so nothing is "
            "reduced until the whole backward is done",
            fix=f"Lower bucket_cap_mb (now {opts.get('bucket_cap_mb', '?')}) so several buckets "
            "overlap the backward; DDP's default is 25.",
            details=details,
        )
        return
    yield Finding(
        "comm_bound",
        "info",
        sorted(run.ranks),
        f"{waiting} ({len(layout)} bucket(s), {total / 2**20:.1f} MB): communication, not "
        "compute, sets the pace",
        fix="Expected for small models or slow links. To trade it down: a larger per-rank batch, "
        "gradient accumulation with no_sync(), or a compression hook (fp16/bf16).",
        details=details,
    )
