"""Stragglers: ranks that arrive late at the gradient sync, and which phase makes them late.

Lateness needs no cross-host clock: a bucket's all-reduce finishes at about the same moment
on every rank, so a rank that got the step's last bucket ready d µs after the earliest one
spent d µs less in that all-reduce. Each step's time since the previous sync is then split
into phases on each rank (data wait, forward, backward up to the last bucket, optimizer, other),
and the late rank's phases are compared with the other ranks' at the same steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from ddpdoctor.analysis.findings import Finding, detector, rank_list
from ddpdoctor.analysis.slow.device import clock, device_timed
from ddpdoctor.analysis.slow.phases import (
    StepGrid,
    exclusive_durations,
    first_per_step,
    median_period,
    training_forwards,
)
from ddpdoctor.analysis.slow.stalls import (
    OTHER_LOADER_FIX,
    costliest,
    other_loader,
    training_span_us,
    where_time_went,
)
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import RankTrace, Run

PHASES = ("data_wait", "forward", "backward", "optimizer", "other")
LATE_FRACTION = 0.05  # of the step time: below this a rank is on time
LATE_FLOOR_US = 300
PERSISTENT = 0.6  # late on this share of steps (3/world if smaller), and at the median step
MIN_STEPS = 6  # fewer shared steps than this say nothing reliable
OCCASIONAL_FACTOR = 3.0  # an occasional straggler must be this many thresholds late
COST_WARNING = 0.05  # of the job's time: a cost worth a warning, however few steps
COST_WARNING_S = 0.5  # and in all: a few ms of stalls in a short job are not worth one
CHANCE = 1e-4  # a persistent straggler is the latest more often than chance would make it (p)
_FIX = {
    "data_wait": "Its DataLoader cannot keep up: raise num_workers, use pin_memory and "
    "persistent_workers, or move decoding/augmentation off the critical path; check the rank's "
    "disk or network share.",
    "forward": "Its forward is slower: check that rank's device (clocks, throttling, other "
    "processes on the GPU), unequal input sizes per rank, or rank-dependent code in forward.",
    "backward": "Its backward is slower: check that rank's device and for rank-dependent "
    "computation or input sizes.",
    "optimizer": "Its optimizer step is slower: look for rank-specific work after backward "
    "(logging, metrics, CPU-GPU copies) or a slower device.",
    "other": "The time goes in your own code between steps (logging, checkpointing, metrics, "
    "host-device syncs like .item()) on that rank: move it off the step or do it on every rank "
    "asynchronously.",
}
_CPU_FIX = (
    "The rank was ready to run and had no CPU: the host runs more busy threads than it has cores "
    "(ranks x torch threads, DataLoader workers, other jobs). Give each rank its share: "
    "OMP_NUM_THREADS or torch.set_num_threads(cores // ranks per host), fewer loader workers, "
    "or pin ranks to cores (taskset, numactl)."
)


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


def _rank_rows(trace: RankTrace, grid: StepGrid) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """(the grid steps this rank has everything for, its per-step values in µs on the grid:
    PHASES and "last_dur"); None without forwards, backwards or bucket timings."""
    fwd = training_forwards(trace)
    bwd = trace.kind(schema.BACKWARD)
    ar = trace.kind(schema.ALLREDUCE)
    if not len(fwd) or not len(bwd) or not len(ar):
        return None
    fdur, has_fwd = grid.put(fwd.step, fwd.dur)  # a repeated step keeps its last forward
    start, has_bwd = grid.put(bwd.step, bwd.ts)
    end, _ = grid.put(bwd.step, bwd.end)
    # The step's last bucket (highest index: DDP fills buckets from the output layers back)
    # is the one the whole step waits for; the first event of that index if it repeats.
    step, index = ar.step, ar.ints(0, default=0)
    top, _ = grid.put(step, index.astype(np.float64), np.maximum)
    is_top = np.flatnonzero(index == top[np.clip(step - grid.lo, 0, grid.n - 1)])
    ready, has_ar = grid.put(*first_per_step(step[is_top], ar.ts[is_top]))
    last_dur, _ = grid.put(*first_per_step(step[is_top], ar.dur[is_top]))
    prev_end, has_prev = np.roll(end, 1), np.roll(has_bwd, 1)
    has_prev[0] = False  # the step before the grid
    waits, opt = trace.kind(schema.DATA_WAIT), trace.kind(schema.OPTIMIZER)
    parts = {  # waits before step k, and the optimizer step that ends k-1, carry label k-1
        "data_wait": grid.put(waits.step + 1, waits.dur, np.add)[0],
        "optimizer": grid.put(opt.step + 1, exclusive_durations(trace, schema.OPTIMIZER), np.add)[0],
        "forward": fdur,
        "backward": np.maximum(0.0, ready - start),
    }
    parts["other"] = np.maximum(0.0, (ready - prev_end) - sum(parts.values()))
    parts["last_dur"] = last_dur
    runq, has_runq = grid.put(bwd.step, bwd.ints(0, default=-1).astype(np.float64))
    has_runq &= runq >= 0
    known = has_runq & np.roll(has_runq, 1)
    parts["cpu_wait"] = np.where(known & has_prev, runq - np.roll(runq, 1), np.nan)
    return has_fwd & has_bwd & has_prev & has_ar, parts


def sync_table(run: Run) -> SyncTable | None:
    """Lateness and phase split for every step all ranks share; None without bucket timings.

    The (ranks, steps) matrices are float32 (µs: exact below 16 s): at 1,024 ranks x 10,000
    steps each is 40 MB. Ranks are folded in one at a time, so nothing per rank is kept."""
    run = device_timed(run)  # device spans when the ranks recorded them
    ranks = sorted(run.ranks)
    if len(ranks) < 2:
        return None
    spanned, step_us = _steps_and_period(run, ranks)
    grid = StepGrid(spanned.lo - 1, spanned.n + 1)  # and the step before: its backward's end
    matrices = {name: np.empty((len(ranks), grid.n), np.float32) for name in (*PHASES, "last_dur")}
    cpu_wait = None  # allocated at the first rank whose kernel said (NaN rows before it)
    common = np.ones(grid.n, bool)
    for i, r in enumerate(ranks):
        rows = _rank_rows(run.ranks[r], grid)
        if rows is None:
            return None
        complete, values = rows
        common &= complete
        for name, m in matrices.items():
            m[i] = values[name]
        if cpu_wait is None and not np.isnan(values["cpu_wait"]).all():
            cpu_wait = np.full((len(ranks), grid.n), np.nan, np.float32)
        if cpu_wait is not None:
            cpu_wait[i] = values["cpu_wait"]
    if common.sum() < MIN_STEPS:
        return None
    shared = _columns(common)
    for name in list(matrices):  # one at a time: a single copy's worth of memory at a time
        matrices[name] = matrices[name][:, shared]
    last_dur = matrices.pop("last_dur")
    lateness = lateness_from_waits(last_dur, out=last_dur)
    cpu_wait = cpu_wait[:, shared] if cpu_wait is not None else None
    known = cpu_wait is not None and not np.isnan(cpu_wait).all()
    return SyncTable(ranks, grid.steps[common], lateness, matrices, step_us, cpu_wait if known else None)


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
        diffs.append(np.diff(fwd.ts))
    return StepGrid.spanning(bounds), median_period(diffs)


def lateness_from_waits(waits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(ranks, steps) lateness from each rank's wait in the step's last bucket all-reduce (or
    any sync point every rank leaves together): the rank that waited longest arrived first, and
    every other rank is late by how much less it waited. The trace analysis and `top` both
    (``out=waits``: in place, where the waits are not needed after)."""
    return np.subtract(waits.max(axis=0, keepdims=True), waits, out=out)


def late_threshold_us(step_us: float) -> float:
    """Lateness below this is on time: a share of the step, never below a floor."""
    return max(LATE_FRACTION * step_us, LATE_FLOOR_US)


def persistent_stragglers(lateness: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """The straggler rule, for the trace analysis and `top` alike: (the row latest at each step,
    per row whether it is a persistent straggler). Persistent: the latest, by more than
    ``threshold``, on at least min(60 %, 3/world) of the steps; its typical lateness stands out
    from the typical rank's by more than ``threshold`` (with many ranks someone is always a
    little late); and it is the latest more often than chance makes a healthy rank (p < CHANCE)."""
    n_ranks, n_steps = lateness.shape
    latest = lateness.argmax(axis=0)
    standout = _standout(np.median(lateness, axis=1))
    needed = min(PERSISTENT, 3 / n_ranks)
    persistent = np.zeros(n_ranks, bool)
    for row in range(n_ranks):
        is_latest = latest == row
        n_late = int((is_latest & (lateness[row] > threshold)).sum())
        persistent[row] = (
            n_late / n_steps >= needed
            and standout[row] > threshold
            and by_chance(int(is_latest.sum()), n_steps, n_ranks) < CHANCE
        )
    return latest, persistent


def sync_lateness(run: Run) -> SyncTable | None:
    """The straggler table without its phase split, kept for the run: the report's heatmap
    shows its lateness. The phases (five of the six matrices, 200 MB at 1,024 ranks x 10,000
    steps) are read by the straggler finding alone and freed once it is judged."""
    return run.once(_LATENESS, lambda r: _lateness_only(sync_table(r)))


_LATENESS = "sync_lateness"


def _lateness_only(table: SyncTable | None) -> SyncTable | None:
    return None if table is None else replace(table, phases={}, cpu_wait=None)


def attribute(table: SyncTable, row: int, late_steps: np.ndarray) -> dict[str, float]:
    """Median excess (µs) of each phase on the late rank over the others, on its late steps."""
    excess = {}
    rest = np.delete(np.arange(len(table.ranks)), row)
    for phase, values in table.phases.items():
        # Steps as rows of one contiguous copy, partitioned in place: the median partitions
        # contiguous memory, and one copy is 40 MB at 1,024 ranks x 10,000 steps.
        others = values.T[np.ix_(late_steps, rest)]
        diff = values[row, late_steps] - np.median(others, axis=1, overwrite_input=True)
        excess[phase] = float(np.median(diff))
    return excess


def cpu_wait_excess(table: SyncTable, row: int, late_steps: np.ndarray) -> float | None:
    """Median run-queue delay (µs) of the late rank over the others' on its late steps; None
    where the kernel did not say."""
    if table.cpu_wait is None:
        return None
    values = table.cpu_wait[:, late_steps]
    if np.isnan(values).any():
        return None
    others = np.median(np.delete(values, row, axis=0), axis=0)
    return float(np.median(values[row] - others))


def by_chance(n_late: int, n_steps: int, world: int) -> float:
    """P(a healthy rank is the latest on >= n_late of n_steps): each step's latest is 1 of world."""
    if n_late <= 0 or world < 2:
        return 1.0
    log_p, log_q = math.log(1 / world), math.log1p(-1 / world)
    base = math.lgamma(n_steps + 1)
    return sum(
        math.exp(base - math.lgamma(k + 1) - math.lgamma(n_steps - k + 1) + k * log_p + (n_steps - k) * log_q)
        for k in range(n_late, n_steps + 1)
    )


def _standout(typical: np.ndarray) -> np.ndarray:
    """Each value minus the median of all the others (sorted once, not once per rank)."""
    n = len(typical)
    if n < 2:
        return np.zeros(n)
    order = np.sort(typical)
    pos = np.searchsorted(order, typical)  # where each value sits (any equal copy will do)
    m = n - 1  # the others: order without one copy of the value

    def kth(k: np.ndarray) -> np.ndarray:
        return order[np.where(k < pos, k, k + 1)]

    lo, hi = kth(np.full(n, (m - 1) // 2)), kth(np.full(n, m // 2))
    return typical - (lo + hi) / 2


@detector
def stragglers(run: Run) -> Iterable[Finding]:
    table = sync_table(run)
    run.once(_LATENESS, lambda _: _lateness_only(table))  # the heatmap's share, built once
    if table is None or not table.step_us:
        return
    threshold = late_threshold_us(table.step_us)
    latest, persistent_rows = persistent_stragglers(table.lateness, threshold)
    slow_rows: set[int] = set()
    span_us: float | None = None
    for finding, rows in slow_nodes(run, table, threshold):
        slow_rows |= rows
        yield finding
    for row, rank in enumerate(table.ranks):
        if row in slow_rows:
            continue  # its node is slow as a whole: said once, for the node
        late = (latest == row) & (table.lateness[row] > threshold)
        n_late = int(late.sum())
        persistent = bool(persistent_rows[row])
        if not persistent:
            late &= table.lateness[row] > OCCASIONAL_FACTOR * threshold
            late = costliest(table.lateness[row], late)
            n_late = int(late.sum())
        if n_late == 0:
            continue
        late_steps = np.flatnonzero(late)
        share = n_late / len(table.steps)
        excess = attribute(table, row, late_steps)
        phase = max(excess, key=lambda p: excess[p])
        excess_ms = float(np.median(table.lateness[row, late_steps])) / 1e3
        step_ms = table.step_us / 1e3
        speedup = step_ms / max(step_ms - excess_ms * share, 1e-9)
        steps_list = [int(s) for s in table.steps[late_steps]]
        details = {
            "phase": phase,
            "excess_ms_per_step": round(excess_ms * share, 3),
            "lateness_ms_when_late": round(excess_ms, 3),
            "what_if_speedup": round(speedup, 3),
            "late_steps": steps_list[:50],
            "late_share": round(share, 3),
            "step_ms": round(step_ms, 3),
            "phase_excess_ms": {p: round(v / 1e3, 3) for p, v in excess.items()},
            "clock": clock(run),  # "device": measured with CUDA events
        }
        reading = other_loader(run.ranks[rank], steps_list) if phase == "data_wait" else None
        if reading is not None:
            details["loader"] = reading
        if sum(max(0.0, v) for v in excess.values()) < 0.5 * excess_ms * 1e3:
            # The rank's own phases are no longer than the others': the "lateness" is noise in
            # when completions were observed (a descheduled callback thread), not a straggler.
            continue
        waited = cpu_wait_excess(table, row, late_steps)
        # Late because it had no CPU, not because of its own work: the host's doing.
        # A rank reading a loader the others never read does work only it does: waiting for a CPU
        # stretches that work, it is not the cause.
        starved = waited is not None and waited >= 0.5 * excess_ms * 1e3 and reading is None
        if waited is not None:
            details["cpu_wait_ms"] = round(waited / 1e3, 3)
        starving = f", {waited / 1e3:.1f} ms of it waiting for a CPU" if starved else ""
        if persistent:
            yield Finding(
                "straggler",
                "warning",
                [rank],
                f"rank {rank} arrives last at the gradient sync in {n_late} of {len(table.steps)} "
                f"steps, {excess_ms:.1f} ms late (of a {step_ms:.1f} ms step{starving}), mostly in "
                f"{where_time_went(phase, reading)}; the job would run {speedup:.2f}x faster if it kept up",
                fix=_CPU_FIX if starved else OTHER_LOADER_FIX if reading else _FIX[phase],
                details=details,
            )
        elif n_late >= 2:
            shown = ", ".join(str(s) for s in steps_list[:8])
            # Severity by cost, not by how few steps it hits: the others wait every time.
            lost_us = excess_ms * n_late * 1e3
            if span_us is None:  # once per run: it reads every rank's forwards
                span_us = training_span_us(run, table.steps)
            cost = min(1.0, lost_us / (span_us or table.step_us * len(table.steps) + lost_us))
            details["cost_share"] = round(cost, 4)
            # A stall (half a step or more each time), not jitter, that costs the job 5 %.
            # Not when it waited for a CPU: now and then one rank of an oversubscribed host.
            lost_s = excess_ms * n_late / 1e3
            costly = (
                cost >= COST_WARNING
                and lost_s >= COST_WARNING_S
                and excess_ms >= 0.5 * step_ms
                and not starved
            )
            yield Finding(
                "straggler_occasional",
                "warning" if costly else "info",
                [rank],
                f"rank {rank} was late at the gradient sync on {n_late} of {len(table.steps)} steps "
                f"({shown}{'...' if n_late > 8 else ''}), by {excess_ms:.1f} ms{starving}, mostly in "
                f"{where_time_went(phase, reading)}: {100 * cost:.0f} % of the job's time",
                fix=("" if costly or reading else "Occasional noise unless those steps matter; ")
                + (_CPU_FIX if starved else OTHER_LOADER_FIX if reading else _FIX[phase]),
                details=details,
            )


def _nodes(run: Run, ranks: list[int]) -> dict[str, list[int]]:
    """Rows of the table by node: its host, and the launcher's node rank when one host runs two."""
    nodes: dict[str, list[int]] = {}
    for row, rank in enumerate(ranks):
        header = run.ranks[rank].header
        node = header.get("node")
        key = str(header.get("host") or "?") + (f" (node {node})" if isinstance(node, int) else "")
        nodes.setdefault(key, []).append(row)
    return nodes


def slow_nodes(run: Run, table: SyncTable, threshold: float) -> Iterable[tuple[Finding, set[int]]]:
    """A node whose every rank arrives late at the gradient sync on most steps: the node is
    slow (its hardware, its load, its data path), not one rank now and then."""
    nodes = _nodes(run, table.ranks)
    if len(nodes) < 2:
        return
    for name, rows in sorted(nodes.items()):
        if len(rows) < 2 or len(rows) == len(table.ranks):
            continue
        node_late = table.lateness[rows].min(axis=0)  # even its earliest rank is late
        late = node_late > threshold
        if late.mean() < PERSISTENT or float(np.median(node_late)) <= threshold:
            continue
        # With a few nodes one of them is the latest on most of a short run's steps by chance.
        if by_chance(int(late.sum()), len(table.steps), len(nodes)) >= CHANCE:
            continue
        rest = [i for i in range(len(table.ranks)) if i not in rows]
        steps = np.flatnonzero(late)
        excess = {
            p: float(np.median(v[rows][:, steps].mean(axis=0) - np.median(v[rest][:, steps], axis=0)))
            for p, v in table.phases.items()
        }
        phase = max(excess, key=lambda p: excess[p])
        late_ms = float(np.median(node_late[steps])) / 1e3
        step_ms = table.step_us / 1e3
        share = len(steps) / len(table.steps)
        speedup = step_ms / max(step_ms - late_ms * share, 1e-9)
        ranks = [table.ranks[i] for i in rows]
        finding = Finding(
            "slow_node",
            "warning",
            ranks,
            f"node {name} is slow as a whole: all its ranks ({rank_list(ranks)}) arrive at the "
            f"gradient sync {late_ms:.1f} ms late (of a {step_ms:.1f} ms step) on {len(steps)} of "
            f"{len(table.steps)} steps, mostly in {phase}; the job would run {speedup:.2f}x "
            "faster if the node kept up",
            fix="Look at that node, not at one rank: its CPUs, GPUs (clocks, thermals), memory and "
            "data path (a slower disk or network share), and what else runs there; "
            + _FIX[phase][0].lower()
            + _FIX[phase][1:],
            details={"node": name, "phase": phase, "lateness_ms": round(late_ms, 3),
                     "late_share": round(share, 3), "step_ms": round(step_ms, 3),
                     "what_if_speedup": round(speedup, 3),
                     "phase_excess_ms": {p: round(v / 1e3, 3) for p, v in excess.items()}},
        )  # fmt: skip
        yield finding, set(rows)
