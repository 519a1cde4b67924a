"""The straggler table: per (rank, step), how late each rank arrived at the gradient sync and
how its time since the previous sync split into phases, over the steps every rank completed.

Lateness needs no cross-host clock: a bucket's all-reduce finishes at about the same moment
on every rank, so a rank that got the step's last bucket ready d µs after the earliest one
spent d µs less in that all-reduce. The straggler finding (``straggler.py``) judges the table;
the report's heatmap shows its lateness.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ddpdoctor.analysis.slow.device import device_timed
from ddpdoctor.analysis.slow.phases import (
    StepGrid,
    cpu_wait,
    last_buckets,
    median_period,
    narrow_periods,
    optimizer_durations,
    training_forwards,
)
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import RankTrace, Run

PHASES = ("data_wait", "forward", "backward", "optimizer", "other")
MIN_STEPS = 6  # fewer shared steps than this say nothing reliable


@dataclass
class SyncTable:
    """Per (rank, step) arrays over the steps every rank completed: µs."""

    ranks: list[int]
    steps: np.ndarray
    lateness: np.ndarray  # (ranks, steps): arrival at the last bucket after the earliest rank
    phases: dict[str, np.ndarray]  # phase -> (ranks, steps)
    step_us: float  # median step period
    # (ranks, steps): the training thread's run-queue delay since the previous step's backward
    # ended (probes/cpuwait.py), NaN where unknown: time it was ready to run and had no CPU.
    cpu_wait: np.ndarray | None = None
    untimed: bool = False  # lateness at the start of backward: the run has no bucket timings


def _rank_rows(
    trace: RankTrace, grid: StepGrid, untimed: bool
) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """(the grid steps this rank has everything for, its per-step values in µs on the grid:
    PHASES and "last_dur"); None without forwards or backwards, or bucket timings unless the
    run has none (``untimed``)."""
    fwd = training_forwards(trace)
    bwd = trace.kind(schema.BACKWARD)
    ar = trace.kind(schema.ALLREDUCE)
    if not len(fwd) or not len(bwd) or not (len(ar) or untimed):
        return None
    fdur, has_fwd = grid.put(fwd.step, fwd.dur)  # a repeated step keeps its last forward
    start, has_bwd = grid.put(bwd.step, bwd.ts)
    end, _ = grid.put(bwd.step, bwd.end)
    if untimed:  # every rank leaves backward as the last reduction ends: its time in backward
        ready, has_ar, last_dur = start, has_bwd, end - start  # is the wait, compute included
    else:
        step = ar.step  # the whole step waits for its last bucket
        last = last_buckets(step, ar.ints(0, default=0))
        ready, has_ar = grid.put(step[last], ar.ts[last])
        last_dur, _ = grid.put(step[last], ar.dur[last])
        seq, _ = grid.put(step[last], ar.ints(2, default=-1)[last] + 1.0)  # 0: not known
    prev_end, has_prev = np.roll(end, 1), np.roll(has_bwd, 1)
    has_prev[0] = False  # the step before the grid
    waits, opt = trace.kind(schema.DATA_WAIT), trace.kind(schema.OPTIMIZER)
    parts = {  # waits before step k, and the optimizer step that ends k-1, carry label k-1
        "data_wait": grid.put(waits.step + 1, waits.dur, np.add)[0],
        "optimizer": grid.put(opt.step + 1, optimizer_durations(trace), np.add)[0],
        "forward": fdur,
        "backward": np.maximum(0.0, ready - start),
    }
    parts["other"] = np.maximum(0.0, (ready - prev_end) - sum(parts.values()))
    parts["last_dur"] = last_dur
    parts["cpu_wait"] = cpu_wait(trace, grid)
    parts["seq"] = np.zeros(grid.n) if untimed else seq
    return has_fwd & has_bwd & has_prev & has_ar, parts


def sync_table(run: Run) -> SyncTable | None:
    """Lateness and phase split for every step all ranks share; None without bucket timings.

    The (ranks, steps) matrices are float32 (µs: exact below 16 s): at 1,024 ranks x 10,000
    steps each is 40 MB. Ranks are folded in one at a time, so nothing per rank is kept.

    A step number names the same step on every rank only while their step counts keep pace:
    under a Join context the rank that ran out of batches shadows the others' remaining
    all-reduces without steps of its own, and its next step number is another rank's earlier
    step. A step whose last gradient bucket the ranks numbered differently (its all-reduce's
    sequence number) is not one step across them, and is left out of the table."""
    run = device_timed(run)  # device spans when the ranks recorded them
    ranks = sorted(run.ranks)
    if len(ranks) < 2:
        return None
    spanned, step_us = _steps_and_period(run, ranks)
    grid = StepGrid(spanned.lo - 1, spanned.n + 1)  # and the step before: its backward's end
    matrices = {name: np.empty((len(ranks), grid.n), np.float32) for name in (*PHASES, "last_dur")}
    waits = None  # cpu_wait, allocated at the first rank whose kernel said (NaN rows before it)
    common = np.ones(grid.n, bool)
    first_seq: np.ndarray | None = None  # the first rank's last bucket's number, + 1, per step
    # Buckets untimed on some rank (DDPDOCTOR_BUCKET_TIMING): every rank's arrival is then
    # taken at the start of its backward, so that all are measured alike; a rank slow inside
    # its backward is not seen.
    untimed = any(not len(run.ranks[r].kind(schema.ALLREDUCE)) for r in ranks)
    for i, r in enumerate(ranks):
        rows = _rank_rows(run.ranks[r], grid, untimed)
        if rows is None:
            return None
        complete, values = rows
        common &= complete
        seq = values["seq"]
        if first_seq is None:
            first_seq = seq
        else:
            common &= (seq == first_seq) | (seq == 0) | (first_seq == 0)
        for name, m in matrices.items():
            m[i] = values[name]
        if waits is None and not np.isnan(values["cpu_wait"]).all():
            waits = np.full((len(ranks), grid.n), np.nan, np.float32)
        if waits is not None:
            waits[i] = values["cpu_wait"]
    if common.sum() < MIN_STEPS:
        return None
    shared = _columns(common)
    for name in list(matrices):  # one at a time: a single copy's worth of memory at a time
        matrices[name] = matrices[name][:, shared]
    last_dur = matrices.pop("last_dur")
    lateness = lateness_from_waits(last_dur, out=last_dur)
    waits = waits[:, shared] if waits is not None else None
    waits = None if waits is None or np.isnan(waits).all() else waits
    return SyncTable(ranks, grid.steps[common], lateness, matrices, step_us, waits, untimed)


def _columns(common: np.ndarray) -> slice | np.ndarray:
    """The shared steps as a slice where they are one run (the usual case: every step but the
    grid's first), so the tables are views, not 40 MB copies; else the mask."""
    at = np.flatnonzero(common)
    return slice(int(at[0]), int(at[-1]) + 1) if len(at) and at[-1] - at[0] + 1 == len(at) else common


def _steps_and_period(run: Run, ranks: list[int]) -> tuple[StepGrid, float]:
    """The training steps' grid and the median step period (µs, forward to forward), in one
    pass over the ranks' training forwards, before the tables are allocated."""
    bounds, diffs = [], []
    for r in ranks:
        fwd = training_forwards(run.ranks[r])
        step = fwd.step
        step = step[step >= 0]
        bounds.append(np.array([step.min(), step.max()]) if len(step) else step)
        diffs.append(narrow_periods(np.diff(fwd.ts)))
    return StepGrid.spanning(bounds), median_period(diffs)


def lateness_from_waits(waits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(ranks, steps) lateness from each rank's wait in the step's last bucket all-reduce (or
    any sync point every rank leaves together): the rank that waited longest arrived first, and
    every other rank is late by how much less it waited. The trace analysis and `top` both
    (``out=waits``: in place, where the waits are not needed after)."""
    return np.subtract(waits.max(axis=0, keepdims=True), waits, out=out)


def sync_lateness(run: Run) -> SyncTable | None:
    """The straggler table without its phase split, kept for the run: the report's heatmap
    shows its lateness. The phases (five of the six matrices, 200 MB at 1,024 ranks x 10,000
    steps) are read by the straggler finding alone and freed once it is judged."""
    return run.once(_LATENESS, lambda r: _lateness_only(sync_table(r)))


def judged_table(run: Run) -> SyncTable | None:
    """``sync_table(run)`` for the straggler finding to judge: its lateness is kept for the run
    (``sync_lateness`` returns it without building the table again), its phases are not."""
    table = sync_table(run)
    run.once(_LATENESS, lambda _: _lateness_only(table))
    return table


_LATENESS = "sync_lateness"


def _lateness_only(table: SyncTable | None) -> SyncTable | None:
    return None if table is None else replace(table, phases={}, cpu_wait=None)
