"""Stragglers: ranks that arrive late at the gradient sync, and which phase makes them late.

The straggler table (``synctable.py``) holds each rank's lateness and phase split per step (data
wait, forward, backward up to the last bucket, optimizer, other); the late rank's phases are
compared here with the other ranks' at the same steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from ddpdoctor.analysis.findings import Finding, large_detector, rank_list
from ddpdoctor.analysis.slow.device import clock
from ddpdoctor.analysis.slow.phases import cpu_wait_excess
from ddpdoctor.analysis.slow.stalls import (
    LARGER_FIX,
    OTHER_LOADER_FIX,
    costliest,
    inputs_cut_at,
    larger_batches,
    other_loader,
    training_span_us,
    where_time_went,
)
from ddpdoctor.analysis.slow.synctable import SyncTable, judged_table
from ddpdoctor.analysis.slow.threads import map_threads
from ddpdoctor.analysis.slow.where import line_text, straggler_line
from ddpdoctor.trace.reader import Run

LATE_FRACTION = 0.05  # of the step time: below this a rank is on time
LATE_FLOOR_US = 300
PERSISTENT = 0.6  # late on this share of steps (3/world if smaller), and at the median step
OCCASIONAL_FACTOR = 3.0  # an occasional straggler must be this many thresholds late
COST_WARNING = 0.05  # of the job's time: a cost worth a warning, however few steps
# and in all, for every kind of lateness: a few ms lost in a short job are not worth one (and
# there one moment of contention on the host can cover most of the steps)
COST_WARNING_S = 0.5
CHANCE = 1e-4  # a persistent straggler is the latest more often than chance would make it (p)
# and late on this many steps at least: on a shared host one rank can be slower for a few steps
# in a row (the chance model takes steps as independent; contention is not)
MIN_LATE_STEPS = 10
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


def late_threshold_us(step_us: float) -> float:
    """Lateness below this is on time: a share of the step, never below a floor."""
    return max(LATE_FRACTION * step_us, LATE_FLOOR_US)


def persistent_stragglers(lateness: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """The straggler rule, for the trace analysis and `top` alike: (the row latest at each step,
    per row whether it is a persistent straggler). Persistent: the latest, by more than
    ``threshold``, on at least min(60 %, 3/world) of the steps and on ``MIN_LATE_STEPS``; its
    typical lateness stands out from the typical rank's by more than ``threshold`` (with many
    ranks someone is always a little late); and it is the latest more often than chance makes
    a healthy rank (p < CHANCE)."""
    n_ranks, n_steps = lateness.shape
    latest = column_argmax(lateness)
    standout = _standout(row_medians(lateness))
    needed = min(PERSISTENT, 3 / n_ranks)
    persistent = np.zeros(n_ranks, bool)
    for row in range(n_ranks):
        is_latest = latest == row
        n_late = int((is_latest & (lateness[row] > threshold)).sum())
        persistent[row] = (
            n_late >= MIN_LATE_STEPS
            and n_late / n_steps >= needed
            and standout[row] > threshold
            and by_chance(int(is_latest.sum()), n_steps, n_ranks) < CHANCE
        )
    return latest, persistent


def attribute(table: SyncTable, row: int, late_steps: np.ndarray) -> dict[str, float]:
    """Median excess (µs) of each phase on the late rank over the others, on its late steps
    (the phases two at a time: their gathers and partitions release the GIL)."""
    rest = np.delete(np.arange(len(table.ranks)), row)

    def phase_excess(values: np.ndarray) -> float:
        # Steps as rows of contiguous copies, partitioned in place: the median partitions
        # contiguous memory; a few MB of steps at a time, not one 40 MB copy at 1,024 ranks.
        step = max(1, CHUNK_CELLS // len(rest))
        medians = [
            np.median(values.T[np.ix_(late_steps[i : i + step], rest)], axis=1, overwrite_input=True)
            for i in range(0, len(late_steps), step)
        ]
        diff = values[row, late_steps] - np.concatenate(medians)
        return float(np.median(diff))

    return dict(zip(table.phases, map_threads(phase_excess, list(table.phases.values())), strict=True))


CHUNK_CELLS = 1 << 20  # cells of a (ranks, steps) table copied at a time for a median


def row_medians(table: np.ndarray) -> np.ndarray:
    """``np.median(table, axis=1)``, a few MB of rows copied at a time, not the whole table
    (each row's median is its own: the same values)."""
    rows = max(1, CHUNK_CELLS // max(1, table.shape[1]))
    parts = [np.median(table[i : i + rows], axis=1) for i in range(0, len(table), rows)]
    return np.concatenate(parts) if parts else np.median(table, axis=1)


def column_argmax(table: np.ndarray) -> np.ndarray:
    """``table.argmax(axis=0)``, a few MB of columns at a time: argmax along the rows of a
    row-major table copies it whole first (40 MB at 1,024 ranks x 10,000 steps)."""
    cols = max(1, CHUNK_CELLS // max(1, len(table)))
    parts = [table[:, j : j + cols].argmax(axis=0) for j in range(0, table.shape[1], cols)]
    return np.concatenate(parts) if parts else table.argmax(axis=0)


def median_cpu_wait_excess(table: SyncTable, row: int, late_steps: np.ndarray) -> float | None:
    """Median run-queue delay (µs) of the late rank over the others' on its late steps; None
    where the kernel did not say."""
    if table.cpu_wait is None:
        return None
    values = table.cpu_wait[:, late_steps]
    if np.isnan(values).any():
        return None
    return float(np.median(cpu_wait_excess(values, row)))


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


def host_starved(late_us: float, own_us: float, waited_us: float, threshold_us: float) -> bool:
    """Late because it had no CPU, not because of its own work: the host's doing, when the
    lateness, or the time its phases took beyond the others' (``own_us``: the two are medians
    taken apart and differ by a few ms on a crowded host), is on time once its extra wait for a
    CPU is taken away. A rank with more work than the others also waits longer for a CPU on a
    crowded host: the wait stretches its work, it is not the cause. (Nor for a rank reading a
    loader the others never read: its caller asks that first.)"""
    return min(late_us, own_us) - waited_us <= threshold_us


@large_detector
def stragglers(run: Run) -> Iterable[Finding]:
    table = judged_table(run)
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
        own = sum(max(0.0, v) for v in excess.values())
        if own < 0.5 * excess_ms * 1e3:
            # The rank's own phases are no longer than the others': the "lateness" is noise in
            # when completions were observed (a descheduled callback thread), not a straggler.
            continue
        waited = median_cpu_wait_excess(table, row, late_steps)
        late_us = excess_ms * 1e3
        starved = waited is not None and reading is None and host_starved(late_us, own, waited, threshold)
        if waited is not None:
            details["cpu_wait_ms"] = round(waited / 1e3, 3)
        starving = (
            f", {waited / 1e3:.1f} ms of it waiting for a CPU"
            if waited is not None and (starved or waited > threshold)
            else ""
        )
        lost_s = excess_ms * n_late / 1e3
        went = "the run queue" if starved else where_time_went(phase, reading)
        if persistent:
            fix = _CPU_FIX if starved else OTHER_LOADER_FIX if reading else _FIX[phase]
            details["lost_s"] = round(lost_s, 3)
            bigger = larger_batches(run, rank) if phase in ("forward", "backward") and not starved else None
            larger, cut = "", ""
            if bigger is not None:
                details["batch_elements"] = bigger
                larger = (
                    f"; its batches are {bigger['ratio']:.1f}x larger ({bigger['elements']:,.0f} tensor "
                    f"elements vs {bigger['others']:,.0f} on the others, {bigger['counted']})"
                )
                cut = inputs_cut_at(run, rank)
                if cut:
                    details["place"] = cut.split(" ")[0]
                    larger += f", its inputs cut by rank at {cut}"
            found = straggler_line(run, rank)
            if found is not None:
                details["where"] = found
                fix = f"Start at {found['where']}, where its time goes. " + fix
            yield Finding(
                "straggler",
                "warning" if lost_s >= COST_WARNING_S else "info",
                [rank],
                f"rank {rank} arrives last at the gradient sync in {n_late} of {len(table.steps)} "
                f"steps, {excess_ms:.1f} ms late (of a {step_ms:.1f} ms step{starving}), mostly in "
                f"{went}{larger}{line_text(found) if found else ''}; the "
                f"job would run {speedup:.2f}x faster if it kept up{_small(lost_s)}",
                fix=LARGER_FIX + (f"Each rank's share is cut at {cut.split(' ')[0]}. " if cut else "") + fix
                if larger
                else fix,
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
                f"{went}: {100 * cost:.0f} % of the job's time",
                fix=("" if costly or reading else "Occasional noise unless those steps matter; ")
                + (_CPU_FIX if starved else OTHER_LOADER_FIX if reading else _FIX[phase]),
                details=details,
            )


def _small(lost_s: float) -> str:
    """Said of a steady lateness that has cost the job too little to warn about (yet)."""
    if lost_s >= COST_WARNING_S:
        return ""
    return f" (it cost {1e3 * lost_s:.0f} ms in all in this run: a note, not a warning, until it costs more)"


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
        lost_s = late_ms * len(steps) / 1e3
        finding = Finding(
            "slow_node",
            "warning" if lost_s >= COST_WARNING_S else "info",
            ranks,
            f"node {name} is slow as a whole: all its ranks ({rank_list(ranks)}) arrive at the "
            f"gradient sync {late_ms:.1f} ms late (of a {step_ms:.1f} ms step) on {len(steps)} of "
            f"{len(table.steps)} steps, mostly in {phase}; the job would run {speedup:.2f}x "
            f"faster if the node kept up{_small(lost_s)}",
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
