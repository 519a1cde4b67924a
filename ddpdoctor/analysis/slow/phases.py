"""Per-rank phase statistics: how long each rank spends at each kind of sync point."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddpdoctor.trace import schema
from ddpdoctor.trace.columns import Events, Packed
from ddpdoctor.trace.rankfile import RankTrace, rank_view


def phase_events(trace: RankTrace, phase: str) -> Events:
    """One phase's events on one rank (a phase may be a subset of its kind: barriers)."""
    p = schema.PHASES[phase]
    ev = trace.kind(p.kind)
    if p.where is None or not len(ev):
        return ev
    hit = ev.equals(p.where[0], p.where[1])
    return ev.select(~hit if p.negate else hit)


def phase_durations(trace: RankTrace, phase: str) -> np.ndarray:
    """Durations (µs) of one phase's events on one rank."""
    if phase == schema.OPTIMIZER:
        return optimizer_durations(trace)
    return phase_events(trace, phase).dur


def optimizer_durations(trace: RankTrace) -> np.ndarray:
    """The optimizer steps' own durations (µs): what is left of each once the forward and the
    backward it ran are taken out (the phase statistics and the straggler table read them)."""
    return trace.view(_optimizer_own).values()


@rank_view
def _optimizer_own(trace: RankTrace) -> Packed:
    """``exclusive_durations`` of the optimizer, packed (a rank view: computed where the trace
    is read, once for the phase statistics and the straggler table)."""
    return Packed.of(exclusive_durations(trace, schema.OPTIMIZER))


# Phases another phase can run inside: Lightning's optimizer.step(closure) runs the forward and
# the backward, so the optimizer's own time is what is left once they are taken out.
NESTED = {schema.OPTIMIZER: (schema.FORWARD, schema.BACKWARD)}


def exclusive_durations(trace: RankTrace, kind: str) -> np.ndarray:
    """Durations (µs) of a kind's events minus the time of the events nested inside them."""
    outer = trace.kind(kind)
    dur = outer.dur
    if not len(outer):
        return dur
    inner_ts, inner_dur = [], []
    for name in NESTED.get(kind, ()):
        ev = trace.kind(name)
        inner_ts.append(ev.ts)
        inner_dur.append(ev.dur)
    if not inner_ts:
        return dur
    ts, d = np.concatenate(inner_ts), np.concatenate(inner_dur)
    if not len(ts):
        return dur
    order = np.argsort(ts, kind="stable")
    ts, ends = ts[order], (ts + d)[order]
    inside = np.concatenate([[0], np.cumsum(d[order])])
    lo = np.searchsorted(ts, outer.ts, side="left")
    hi = np.searchsorted(ts, outer.ts + dur, side="right")
    nested = inside[hi] - inside[lo]
    # An inner event that starts inside but ends after the outer one is not nested in it.
    nested = np.where((hi > lo) & (ends[np.maximum(hi - 1, 0)] <= outer.ts + dur), nested, 0)
    return np.maximum(dur - nested, 0).astype(dur.dtype)


def stats(durations_us: np.ndarray) -> dict[str, Any]:
    """count, total, mean, p50, p95 and max in seconds."""
    n = int(len(durations_us))
    if n == 0:
        return {"count": 0, "total_s": 0.0, "mean_s": 0.0, "p50_s": 0.0, "p95_s": 0.0, "max_s": 0.0}
    p50, p95 = percentiles(durations_us, (50, 95))
    total = int(durations_us.sum())
    return {
        "count": n,
        "total_s": round(total / 1e6, 6),
        "mean_s": round(total / n / 1e6, 6),
        "p50_s": round(p50 / 1e6, 6),
        "p95_s": round(p95 / 1e6, 6),
        "max_s": round(int(durations_us.max()) / 1e6, 6),
    }


def percentiles(values: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """np.percentile's (linear) values, from one partition of the integers themselves: three
    times faster than np.percentile, which copies to float first (9,000 calls at 1,024 ranks)."""
    n = len(values)
    at = [(n - 1) * q / 100 for q in qs]
    kth = sorted({int(a) for a in at} | {min(int(a) + 1, n - 1) for a in at})
    part = np.partition(values, kth)
    out = []
    for a in at:
        lo, hi = int(part[int(a)]), int(part[min(int(a) + 1, n - 1)])
        out.append(lo + (hi - lo) * (a - int(a)))
    return out


@rank_view
def rank_phases(trace: RankTrace) -> dict[str, dict[str, Any]]:
    """Every phase that happened on this rank, with its statistics (a rank view: computed where
    the trace is read)."""
    out: dict[str, dict[str, Any]] = {}
    for phase in schema.PHASES:
        out[phase] = stats(phase_durations(trace, phase))  # count 0 when it never happened
    fwd = trace.kind(schema.FORWARD)
    if len(fwd):
        out["forward"]["no_grad"] = int((fwd.ints(0) == 0).sum())
    return out


def training_forwards(trace: RankTrace) -> Events:
    """The DDP forwards in grad mode, the first of each step: the one that opened it (with two
    DDP models, a GAN's say, the other model's forwards run inside the step)."""
    fwd = trace.kind(schema.FORWARD)
    if not len(fwd):
        return fwd
    grad = np.flatnonzero(fwd.ints(0) == 1)
    step = fwd.step[grad]
    opens = np.ones(len(grad), bool)
    opens[1:] = step[1:] != step[:-1]
    keep = grad if opens.all() else grad[opens]
    return fwd if len(keep) == len(fwd) else fwd.select(keep)  # usually every forward: no copy


def last_per_step(step: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct steps, the value of each step's last event): what a dict keyed by step
    would keep, without a Python loop over events."""
    starts = _runs(step)
    if starts is _EVERY:  # an event per step, in order (a forward, a backward): nothing to pick
        return step, values
    if starts is not None:  # already in step order (the usual trace): no sort needed
        return step[starts], values[np.append(starts[1:], len(step)) - 1]
    rev_steps, first = np.unique(step[::-1], return_index=True)
    return rev_steps, values[::-1][first]


def first_per_step(step: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct steps, the value of each step's first event)."""
    starts = _runs(step)
    if starts is _EVERY:
        return step, values
    if starts is not None:
        return step[starts], values[starts]
    steps, first = np.unique(step, return_index=True)
    return steps, values[first]


def _reduce_runs(
    step: np.ndarray, values: np.ndarray, ufunc: np.ufunc
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(steps, values, whether each step now has one value): ``ufunc`` (a max, a min) over each
    run of equal steps where ``step`` never decreases (one reduceat, not a scatter); as they
    are otherwise."""
    every = _fixed_runs(step)
    if every:  # runs of one length (a step's buckets): a strided pass per position, no reduceat
        out = values[::every].copy()
        for j in range(1, every):
            ufunc(out, values[j::every], out=out)
        return step[::every], out, True
    starts = _runs(step)
    if starts is None:
        return step, values, False
    if starts is _EVERY:
        return step, values, True
    return step[starts], ufunc.reduceat(values, starts), True


_MAX_RUN = 64  # the longest run of equal steps _fixed_runs looks for


def _fixed_runs(step: np.ndarray) -> int:
    """p when ``step`` is runs of exactly p > 1 equal values, each run's value above the one
    before (an all-reduce per bucket: every bucket of every step, in order), else 0."""
    n = len(step)
    if n < 2 or step[0] != step[1]:
        return 0
    head = step[: _MAX_RUN + 1]
    p = int(np.argmax(head != head[0]))
    if p < 2 or n % p:
        return 0
    firsts = step[::p]
    if len(firsts) > 1 and np.diff(firsts).min() <= 0:
        return 0
    return p if all(np.array_equal(step[j::p], firsts) for j in range(1, p)) else 0


def last_buckets(step: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The position of each step's last bucket all-reduce among a rank's (``step``, bucket
    ``index``): the one of the step's highest index, the first if that index repeats. DDP fills
    buckets from the output layers back, so the step waits for it. Where every step reduces
    the same number of buckets in order (the usual trace), the steps are rows of a table and
    each row's top is an argmax (one row's, when all rows match), not a scatter."""
    every = _fixed_runs(step)
    if every:
        rows = index.reshape(-1, every)
        if (rows == rows[0]).all():
            return np.arange(int(rows[0].argmax()), len(step), every)
        return np.arange(0, len(step), every) + rows.argmax(axis=1)
    if not len(step):
        return np.zeros(0, np.intp)
    grid = StepGrid(int(step.min()), int(step.max()) - int(step.min()) + 1)
    top, _ = grid.put(step, index.astype(np.float64), np.maximum)
    at = np.flatnonzero(index == top[step - grid.lo])
    return first_per_step(step[at], at)[1]


_EVERY = np.arange(0)  # _runs' answer when every event is a run of its own


def _runs(step: np.ndarray) -> np.ndarray | None:
    """Where each run of equal steps starts, if ``step`` never decreases; else None; ``_EVERY``
    when each step has one event (one reduction, no index array)."""
    if not len(step):
        return None
    every = _fixed_runs(step)
    if every:
        return np.arange(0, len(step), every)
    jumps = np.diff(step)
    low = jumps.min() if len(jumps) else 1
    if low < 0:
        return None
    if low > 0:
        return _EVERY
    return np.concatenate(([0], np.flatnonzero(jumps) + 1))


@dataclass(frozen=True)
class StepGrid:
    """A run's steps ``lo .. lo + n - 1`` as one dense axis. Per-step values of every rank
    become rows of arrays along it, so matching steps across ranks is indexing and a mask,
    not a search: at 1,024 ranks x 10,000 steps that is what keeps analysis within seconds."""

    lo: int
    n: int

    @classmethod
    def spanning(cls, steps: Iterable[np.ndarray]) -> StepGrid:
        """The grid from the lowest to the highest non-negative step in any of ``steps``."""
        lo, hi = None, None
        for s in steps:
            s = s[s >= 0]
            if len(s):
                lo = int(s.min()) if lo is None else min(lo, int(s.min()))
                hi = int(s.max()) if hi is None else max(hi, int(s.max()))
        return cls(0, 0) if lo is None or hi is None else cls(lo, hi - lo + 1)

    @property
    def steps(self) -> np.ndarray:
        return np.arange(self.lo, self.lo + self.n)

    def put(
        self, step: np.ndarray, values: np.ndarray, ufunc: np.ufunc | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(each grid step's value as float64, which steps have one): the last event's value
        of a step, or ``ufunc`` (np.add, np.maximum...) over its events."""
        reduced = ufunc is None  # one value per step left
        if ufunc is None:
            step, values = last_per_step(step, values)
        elif ufunc is not np.add:  # a max or min: reduced run by run where the steps are in order
            step, values, reduced = _reduce_runs(step, values, ufunc)
        at = step - self.lo
        if len(at) and (at.min() < 0 or at.max() >= self.n):  # two reductions, no masks
            inside = (at >= 0) & (at < self.n)
            at, values = at[inside], values[inside]
        present = np.zeros(self.n, bool)
        if reduced and len(at) and int(at[-1]) - int(at[0]) == len(at) - 1:
            # distinct steps in order without a gap (the usual rank): slices, not a scatter
            lo, hi = int(at[0]), int(at[-1]) + 1
            present[lo:hi] = True
            out = np.zeros(self.n)
            out[lo:hi] = values
            return out, present
        present[at] = True
        if ufunc is np.add:
            return np.bincount(at, weights=values, minlength=self.n), present
        out = np.zeros(self.n)
        out[at] = values  # one of each step's values (the only one once reduced)
        if ufunc is not None and not reduced:  # unbuffered, in place: faster than a sort, if no cast
            ufunc.at(out, at, values.astype(np.float64, copy=False))
        return out, present


def cpu_wait(trace: RankTrace, grid: StepGrid) -> np.ndarray:
    """µs the rank's training thread waited for a CPU in each grid step, from the previous
    step's backward end to this one's (its backward records carry the running total of its
    run-queue delay: probes/cpuwait.py); NaN where the kernel did not say or a step, or the one
    before it, has no backward. The straggler table and the periodic-work rule both read it."""
    bwd = trace.kind(schema.BACKWARD)
    total, has = grid.put(bwd.step, bwd.ints(0, default=-1).astype(np.float64))
    has &= total >= 0
    known = has & np.roll(has, 1)
    known[:1] = False  # the step before the grid
    return np.where(known, total - np.roll(total, 1), np.nan)


def cpu_wait_excess(delay: np.ndarray, row: int) -> np.ndarray:
    """Per step (column of a (ranks, steps) ``cpu_wait`` table), how much longer rank ``row``
    waited for a CPU than the other ranks' median: the part of its lateness that is the host's,
    not its own code's. NaN where it, or every other rank, did not say."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step no other rank said: NaN
        return delay[row] - np.nanmedian(np.delete(delay, row, axis=0), axis=0)


def median_period(diffs: Iterable[np.ndarray]) -> float:
    """The median of every rank's step periods (int µs), 0.0 without any: the periods narrowed
    to int32 where they fit (``narrow_periods``: callers narrow each rank's as they collect
    them) and the median taken in place (at 1,024 ranks x 10,000 steps, 40 MB at a time
    instead of three 80 MB copies)."""
    parts = [narrow_periods(d) for d in diffs]
    periods = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    del parts
    return float(np.median(periods, overwrite_input=True)) if len(periods) else 0.0


def narrow_periods(diffs: np.ndarray) -> np.ndarray:
    """A rank's step periods as int32 where they fit (half the memory, the same median)."""
    if len(diffs) and diffs.dtype != np.int32 and diffs.min() >= -(2**31) and diffs.max() < 2**31:
        return diffs.astype(np.int32)
    return diffs


def step_times(trace: RankTrace) -> np.ndarray:
    """Seconds from one training step's forward to the next's."""
    starts = training_forwards(trace).ts
    return np.diff(starts).astype(np.float64) / 1e6 if len(starts) > 1 else np.zeros(0)


@rank_view
def step_time_stats(trace: RankTrace) -> dict[str, float] | None:
    """The rank's median and 95th percentile step time (s), None without two training steps
    (a rank view: computed where the trace is read)."""
    st = step_times(trace)
    if not len(st):
        return None
    p50, p95 = np.percentile(st, [50, 95])
    return {"p50": round(float(p50), 6), "p95": round(float(p95), 6)}
