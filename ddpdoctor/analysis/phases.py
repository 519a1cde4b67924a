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
        is_barrier = coll.equals(0, schema.BARRIER_OP)
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
        out["forward"]["no_grad"] = int((fwd.ints(0) == 0).sum())
    return out


def training_forwards(trace: RankTrace) -> Events:
    """The DDP forwards in grad mode: one per training step."""
    fwd = trace.kind(schema.FORWARD)
    return fwd.select(fwd.ints(0) == 1) if len(fwd) else fwd


def last_per_step(step: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct steps, the value of each step's last event): what a dict keyed by step
    would keep, without a Python loop over events."""
    starts = _runs(step)
    if starts is not None:  # already in step order (the usual trace): no sort needed
        return step[starts], values[np.append(starts[1:], len(step)) - 1]
    rev_steps, first = np.unique(step[::-1], return_index=True)
    return rev_steps, values[::-1][first]


def _runs(step: np.ndarray) -> np.ndarray | None:
    """Where each run of equal steps starts, if ``step`` never decreases; else None."""
    if not len(step):
        return None
    jumps = np.diff(step)
    if (jumps < 0).any():
        return None
    return np.concatenate(([0], np.flatnonzero(jumps) + 1))


def lookup(keys: np.ndarray, values: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values at ``want`` in sorted unique ``keys``, which were found): a binary search."""
    if not len(keys):
        return np.zeros(len(want), values.dtype), np.zeros(len(want), bool)
    at = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
    return values[at], keys[at] == want


def in_sorted(values: np.ndarray, sorted_unique: np.ndarray) -> np.ndarray:
    """Which of ``values`` are in ``sorted_unique`` (np.isin without its sort)."""
    return lookup(sorted_unique, sorted_unique, values)[1]


def reduce_per_step(step: np.ndarray, values: np.ndarray, ufunc: np.ufunc) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct steps, ``ufunc`` (np.add, np.maximum...) over each step's events)."""
    if not len(step):
        return step, values
    starts = _runs(step)
    if starts is not None:
        return step[starts], ufunc.reduceat(values, starts)
    order = np.argsort(step, kind="stable")
    steps, idx = np.unique(step[order], return_index=True)
    return steps, ufunc.reduceat(values[order], idx)


def step_times(trace: RankTrace) -> np.ndarray:
    """Seconds from one training step's forward to the next's."""
    starts = training_forwards(trace).ts
    return np.diff(starts).astype(np.float64) / 1e6 if len(starts) > 1 else np.zeros(0)
