"""Per-rank phase statistics: how long each rank spends at each kind of sync point."""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Events, RankTrace

# Phase name in reports -> how to select its events from a rank's trace.
PHASES = (
    "ddp_init",
    "forward",
    "sync_buffers",
    "backward",
    "allreduce",
    "barrier",
    "collective",
    "data_wait",
    "optimizer",
)


def phase_durations(trace: RankTrace, phase: str) -> np.ndarray:
    """Durations (µs) of one phase's events on one rank."""
    if phase in ("barrier", "collective"):
        coll = trace.kind(schema.COLLECTIVE)
        if not len(coll):
            return coll.dur
        is_barrier = np.array([f[0] == schema.BARRIER_OP for f in coll.fields], dtype=bool)
        return coll.dur[is_barrier if phase == "barrier" else ~is_barrier]
    return trace.kind(phase).dur


def stats(durations_us: np.ndarray) -> dict[str, Any]:
    """count, total, mean, p50, p95 and max in seconds."""
    n = int(len(durations_us))
    if n == 0:
        return {"count": 0, "total_s": 0.0, "mean_s": 0.0, "p50_s": 0.0, "p95_s": 0.0, "max_s": 0.0}
    d = durations_us.astype(np.float64) / 1e6
    p50, p95 = np.percentile(d, [50, 95])
    return {
        "count": n,
        "total_s": round(float(d.sum()), 6),
        "mean_s": round(float(d.mean()), 6),
        "p50_s": round(float(p50), 6),
        "p95_s": round(float(p95), 6),
        "max_s": round(float(d.max()), 6),
    }


def rank_phases(trace: RankTrace) -> dict[str, dict[str, Any]]:
    """Every phase that happened on this rank, with its statistics."""
    out: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        d = phase_durations(trace, phase)
        if len(d):
            out[phase] = stats(d)
    fwd = trace.kind(schema.FORWARD)
    if len(fwd):
        out["forward"]["no_grad"] = sum(1 for f in fwd.fields if f and f[0] == 0)
    return out


def training_forwards(trace: RankTrace) -> Events:
    """The DDP forwards in grad mode: one per training step."""
    fwd = trace.kind(schema.FORWARD)
    keep = np.array([bool(f and f[0] == 1) for f in fwd.fields], dtype=bool)
    if not len(fwd):
        return fwd
    return Events(
        fwd.ts[keep], fwd.dur[keep], fwd.step[keep], [f for f, k in zip(fwd.fields, keep, strict=False) if k]
    )


def step_times(trace: RankTrace) -> np.ndarray:
    """Seconds from one training step's forward to the next's."""
    starts = training_forwards(trace).ts
    return np.diff(starts).astype(np.float64) / 1e6 if len(starts) > 1 else np.zeros(0)
