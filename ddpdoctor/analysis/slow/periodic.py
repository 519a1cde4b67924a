"""Periodic rank-only work: one rank late at the gradient sync every k steps (logging, metrics,
checkpoints, evaluation on rank 0), judged by what it costs the job, not by how few steps it
hits.

Every other rank waits for the late one at the next sync, so the cost of a 250 ms metrics write
every 5th step is the whole job's: a warning when it is at least ``COST_WARNING`` of the run
time, named with its period and cost. The cost is the rank's own: the lateness less its extra
wait for a CPU (the run-queue delay its backward records carry), which on a crowded host is the
host's doing; a few ms of scheduling noise that happen to fall on a beat are not work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

from ddpdoctor.analysis.findings import Finding, detector
from ddpdoctor.analysis.slow.phases import (
    StepGrid,
    cpu_wait,
    cpu_wait_excess,
    last_buckets,
    training_forwards,
)
from ddpdoctor.analysis.slow.stalls import OTHER_LOADER_FIX, loader_text, other_loader
from ddpdoctor.analysis.slow.straggler import LATE_FLOOR_US
from ddpdoctor.analysis.slow.synctable import lateness_from_waits
from ddpdoctor.analysis.slow.where import line_text, straggler_line
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import RankTrace, Run

COST_WARNING = 0.05  # of the job's training time
COST_NOTE = 0.01  # below this, not worth a line
MIN_EACH_MS = 10.0  # a warning needs work this long each time: a few ms at an epoch's end of a
# tiny job is the host's scheduling, not the user's code
MIN_STEPS = 6
MIN_REPEATS = 3  # late steps needed to call it periodic
REGULAR = 0.7  # share of late steps on the beat, and of the beat's steps that are late
LEVEL_SHARE = 0.25  # a step on the beat is late above this share of a typical occurrence
OFF_BEAT = 0.2  # at most this share of the steps off the beat may be as late
FIX = (
    "Take the rank-only work off the training's critical path: run it in a background thread or "
    "process (write metrics/checkpoints asynchronously), do it less often, or share it across "
    "ranks; every other rank waits for it at the next gradient sync."
)


def beat_of(steps: np.ndarray) -> tuple[int, int] | None:
    """(k, residue): the regular gap between late steps and the residue mod k most of them
    share (one late step off the beat does not break it), or None when they are not regular."""
    if len(steps) < MIN_REPEATS:
        return None
    steps = np.sort(steps)
    k = _most_common(np.diff(steps))[0]
    if k < 3:  # every other step: indistinguishable from two ranks taking turns on busy cores
        return None
    residue, on_beat = _most_common(steps % k)
    return (k, residue) if on_beat >= REGULAR * len(steps) else None


def beat_in(row: np.ndarray) -> tuple[int, np.ndarray] | None:
    """(k, the late steps on the beat) of one rank's lateness per step (µs), or None.

    The beat comes from the clearest occurrences: the steps late by over half the third
    largest lateness (a first run that warms a cache, or a run's last step, can be several
    times the rest). It is then checked on the whole row at a lower bar, a quarter of a
    typical occurrence: most steps on the beat must reach it and few steps off it, or a few
    late steps that share a residue by chance (scheduling noise on a busy host) would pass
    for work every k steps."""
    floor = LATE_FLOOR_US * 3
    if len(row) < MIN_REPEATS:
        return None
    top = float(np.partition(row, -MIN_REPEATS)[-MIN_REPEATS])
    clear = np.flatnonzero(row > max(floor, 0.5 * top))
    if len(clear) > 0.5 * len(row):
        return None  # late on most steps: a straggler, not periodic work
    found = beat_of(clear)
    if found is None:
        return None
    k, residue = found
    on = clear[clear % k == residue]
    bar = max(floor, LEVEL_SHARE * float(np.median(row[on])))
    beat = np.arange(int(on[0]), len(row), k)
    late = beat[row[beat] > bar]
    off = np.ones(len(row) - int(on[0]), bool)
    off[beat - int(on[0])] = False
    off_late = float(np.mean(row[int(on[0]) :][off] > bar)) if off.any() else 0.0
    if len(late) < max(MIN_REPEATS, REGULAR * len(beat)) or off_late > OFF_BEAT:
        return None
    return k, late


def _most_common(values: np.ndarray) -> tuple[int, int]:
    """``Counter(values.tolist()).most_common(1)[0]`` of non-negative integers, by counting:
    the most frequent value and its count, the first to appear among equally frequent ones."""
    if (
        values.dtype.kind not in "iu"
        or not len(values)
        or values.min() < 0
        or values.max() > 4 * len(values) + 1024
    ):
        value, count = Counter(values.tolist()).most_common(1)[0]
        return int(value), int(count)
    counts = np.bincount(values)
    top = int(counts.max())
    tied = np.flatnonzero(counts == top)
    value = tied[0] if len(tied) == 1 else values[np.isin(values, tied)][0]
    return int(value), top


def sync_waits(run: Run) -> tuple[list[int], np.ndarray] | None:
    """(ranks, (ranks, steps) µs each rank spent blocked in sync points per training step: the
    gradient all-reduce's last bucket and every Python collective), over the steps all share.

    A step number names the same step on every rank only while their step counts keep pace:
    under a Join context the rank that ran out of batches shadows the others' remaining
    all-reduces without steps of its own, and its next step number is another rank's earlier
    step. Where every rank's last gradient bucket of a step carries a sequence number and they
    differ, the step is not one step across the ranks: its waits are left out (zero)."""
    ranks = sorted(run.ranks)
    waits: np.ndarray | None = None  # as long as the first rank's row; cut to the shortest
    n = 0
    first: np.ndarray | None = None  # the first rank's last bucket's sequence number per step
    apart: np.ndarray | None = None  # steps whose numbers differ from it on some rank
    for i, r in enumerate(ranks):
        trace = run.ranks[r]
        coll = trace.kind(schema.COLLECTIVE)
        bucket_steps, bucket_durs, bucket_seqs = _last_buckets(trace)
        parts = [(coll.step, coll.dur), (bucket_steps, bucket_durs)]
        steps = np.concatenate([p[0] for p in parts]).astype(np.int64)
        durs = np.concatenate([p[1] for p in parts]).astype(np.float64)
        keep = steps >= 0
        if not keep.any():
            return None
        row = np.bincount(steps[keep], weights=durs[keep])
        if waits is None:  # written in place, row by row: one matrix, not a list and its stack
            waits, n = np.empty((len(ranks), len(row))), len(row)
            apart = np.zeros(len(row), dtype=bool)
        n = min(n, len(row))
        waits[i, :n] = row[:n]
        seq = np.full(len(row), -1, dtype=np.int64)
        known = bucket_steps >= 0
        seq[bucket_steps[known]] = bucket_seqs[known]
        if first is None:
            first = seq
        else:
            m = min(len(first), len(seq), len(apart))
            apart[:m] |= (seq[:m] != first[:m]) & (seq[:m] >= 0) & (first[:m] >= 0)
    if waits is None or apart is None or n < MIN_STEPS:
        return None
    waits = waits[:, :n]
    waits[:, apart[:n]] = 0.0
    return ranks, waits


def own_cpu_wait(run: Run, ranks: list[int], row: int, steps: np.ndarray) -> np.ndarray:
    """µs rank ``ranks[row]`` waited for a CPU during each of ``steps`` beyond the others'
    median; 0 where the kernel did not say or it waited less."""
    grid = StepGrid(0, int(steps.max()) + 1 if len(steps) else 0)
    delay = np.stack([cpu_wait(run.ranks[r], grid)[steps] for r in ranks])
    return np.clip(np.nan_to_num(cpu_wait_excess(delay, row), nan=0.0), 0.0, None)


def _last_buckets(trace: RankTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step, µs, sequence number) of each step's last gradient bucket: the one the step waits
    for. The buckets' all-reduces overlap the backward and each other; summing them counts one
    wait many times."""
    ar = trace.kind(schema.ALLREDUCE)
    steps = ar.step
    last = last_buckets(steps, ar.ints(0, default=0))
    return steps[last], ar.dur[last].astype(np.float64), ar.ints(2, default=-1)[last].astype(np.int64)


@detector
def periodic_work(run: Run) -> Iterable[Finding]:
    if len(run.ranks) < 2:
        return
    found = sync_waits(run)
    if found is None:
        return
    ranks, waits = found
    # A rank that is late makes the others wait for it: its lateness at a step is how much
    # longer the most-waiting rank was blocked than it was.
    lateness = lateness_from_waits(waits, out=waits)
    total_us = 0.0  # the training time: first training forward to the rank's last record
    for r in ranks:
        fwd = training_forwards(run.ranks[r])
        if len(fwd):
            total_us = max(total_us, float(run.ranks[r].last_ts - fwd.ts[0]))
    if total_us <= 0:
        return
    for row, rank in enumerate(ranks):
        found = beat_in(lateness[row])
        if found is None:
            continue
        k, late = found
        # What its own code took: the lateness less the rank's extra wait for a CPU, which on
        # a crowded host is the host's doing (and, with nothing left, all of it).
        waited = own_cpu_wait(run, ranks, row, late)
        own = np.clip(lateness[row, late] - waited, 0.0, None)
        cost_us = float(own.sum())
        share = cost_us / total_us
        if share < COST_NOTE:
            continue
        each_ms, waited_ms = float(np.median(own)) / 1e3, float(np.median(waited)) / 1e3
        speedup = total_us / max(total_us - cost_us, 1.0)
        reading = other_loader(run.ranks[rank], [int(s) for s in late])
        what = "(logging, metrics, checkpoints, evaluation?)"
        if reading:
            what = f"reading {loader_text(reading)}"
        sampled = straggler_line(run, rank)  # sampled while the others waited for it
        # The work hangs off a line of the training loop: the outermost user frame sampled.
        began = (sampled.get("callers") or [sampled["where"]])[-1] if sampled else ""
        if sampled is not None:
            what = f"(at {began})"
        yield Finding(
            "periodic_rank_work",
            "warning" if share >= COST_WARNING and each_ms >= MIN_EACH_MS else "info",
            [rank],
            f"every {k} steps rank {rank} spends {each_ms:.0f} ms in its own code between sync "
            f"points {what}{_waiting(waited_ms)} while the other ranks wait for it at the next "
            "sync point: "
            f"{100 * share:.0f} % of the training time; the job would be {speedup:.2f}x faster "
            f"without it{line_text(sampled) if sampled else ''}",
            fix=(f"Start at {began}: its time goes to {sampled['where']}. " if sampled else "")
            + (OTHER_LOADER_FIX if reading else FIX),
            details={
                "loader": reading,
                "where": sampled,
                "place": began.rpartition(" ")[2] or None,
                "root_rank": rank,
                "period_steps": k,
                "ms_each": round(each_ms, 3),
                "cost_share": round(share, 4),
                "what_if_speedup": round(speedup, 3),
                "late_steps": [int(s) for s in late][:50],
                "cpu_wait_ms": round(waited_ms, 3),
            },
        )


def _waiting(ms: float) -> str:
    """' (and 4 ms more waiting for a CPU)' where the rank's extra run-queue wait is material."""
    return f" (and {ms:.0f} ms more waiting for a CPU)" if ms >= 1.0 else ""
