"""What the reports show that is a statistic, computed once for the Diagnosis.

Step spans on the run's common clock and lateness at the gradient sync (the training loader,
bucket layout and DDP models live beside the analyses that use them). The terminal, the HTML
report and the JSON take these from the Diagnosis; none of them judges anything of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddpdoctor.analysis.slow.phases import StepGrid, training_forwards
from ddpdoctor.analysis.slow.synctable import sync_lateness
from ddpdoctor.trace import schema
from ddpdoctor.trace.merge import TimeBase
from ddpdoctor.trace.reader import Run

LATENESS_AT_LAST_BUCKET = (
    "how much later than the earliest rank each rank got its last gradient bucket ready, per "
    "step (the wait the straggler finding measures)"
)
LATENESS_AT_UNTIMED_SYNC = (
    "how much later than the earliest rank each rank started its backward, per step, measured "
    "by its shorter backward (every rank leaves backward as the last reduction ends; no bucket "
    "timings in this run: a rank slow inside its backward is not seen)"
)
LATENESS_AT_BACKWARD = (
    "how much later than the earliest rank each rank started its backward, per step, on the "
    "aligned clocks (no bucket timings in this run)"
)


@dataclass
class Lateness:
    """Rank x step lateness at the gradient sync, in ms (NaN where a rank has no value)."""

    ranks: list[int]
    steps: list[int]
    ms: np.ndarray  # float32 (ranks, steps)
    definition: str

    def mean_ms(self) -> dict[int, float]:
        with np.errstate(all="ignore"):
            means = np.nanmean(self.ms, axis=1) if self.ms.size else np.zeros(len(self.ranks))
        return {r: round(float(m), 3) for r, m in zip(self.ranks, means) if np.isfinite(m)}


def lateness(run: Run, tb: TimeBase) -> Lateness:
    """The straggler finding's own lateness (arrival at the step's last bucket, which needs no
    common clock) where it is defined; else the start of backward on the aligned clocks,
    under its own name."""
    ranks = sorted(run.ranks)
    table = sync_lateness(run)
    if table is not None:
        what = LATENESS_AT_UNTIMED_SYNC if table.untimed else LATENESS_AT_LAST_BUCKET
        return Lateness(table.ranks, table.steps.tolist(), table.lateness / 1e3, what)
    grid = StepGrid.spanning(run.ranks[r].kind(schema.BACKWARD).step for r in ranks)
    z = np.full((len(ranks), grid.n), np.nan)
    for i, rank in enumerate(ranks):
        ev = run.ranks[rank].kind(schema.BACKWARD)
        first, has = grid.put(ev.step, tb.rel(rank, ev.ts), np.minimum)
        z[i, has] = first[has]
    reached = ~np.isnan(z).all(axis=0)
    z, steps = z[:, reached], grid.steps[reached]
    if z.size:
        with np.errstate(all="ignore"):
            z = (z - np.nanmin(z, axis=0, keepdims=True)) / 1e3
    return Lateness(ranks, steps.tolist(), z.astype(np.float32), LATENESS_AT_BACKWARD)


def step_spans(run: Run, tb: TimeBase) -> dict[int, tuple[float, float]]:
    """Each training step's extent across ranks (seconds on the common base): its first forward
    to the last event labelled with it. Folded rank by rank on the step grid: O(steps) memory."""
    grid = StepGrid.spanning(training_forwards(t).step for t in run.ranks.values())
    starts, ends = np.full(grid.n, np.inf), np.full(grid.n, -np.inf)
    rank_ends = np.empty(grid.n)
    for rank, trace in run.ranks.items():
        fwd = training_forwards(trace)
        first, has = grid.put(fwd.step, tb.rel(rank, fwd.ts), np.minimum)
        starts = np.minimum(starts, np.where(has, first, np.inf))
        rank_ends.fill(-np.inf)  # on the rank's own clock: one shift per rank, not per kind
        for ev in trace.events.values():  # kind by kind: each in step order, so no scatter
            if len(ev):
                last, has = grid.put(ev.step, ev.end, np.maximum)
                np.maximum(rank_ends, last, out=rank_ends, where=has)
        ends = np.maximum(ends, tb.rel(rank, rank_ends), out=ends)
    started = np.isfinite(starts)
    begin, end = starts[started] / 1e6, np.maximum(ends, starts)[started] / 1e6
    return dict(zip(grid.steps[started].tolist(), zip(begin.tolist(), end.tolist())))
