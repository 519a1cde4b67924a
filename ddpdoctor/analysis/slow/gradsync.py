"""Gradient sync quality: per bucket size, names, arrival skew, transfer time, overlap.

Per step and bucket, like the straggler analysis, without cross-host clocks: the all-reduce
ends at about the same moment on every rank, so the shortest wait (the last rank to arrive)
is the transfer itself, and the spread of waits is the arrival skew. Communication that
overlaps the backward is free; what runs after the last gradient is computed is exposed.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np

from ddpdoctor import _env
from ddpdoctor.analysis.findings import Finding, detector, rank_list
from ddpdoctor.analysis.slow.device import clock, device_timed
from ddpdoctor.analysis.slow.phases import StepGrid, last_per_step, median_period, narrow_periods
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run

EXPOSED_SHARE = 0.25  # of the step time: exposed communication worth a finding
BIG_BUCKET = 8 * 2**20  # one bucket this large could have been several overlapping ones
_MAX_BUCKETS = 1 << 16


def bucket_layout(run: Run) -> dict[int, dict[str, Any]]:
    """The latest layout of each bucket (DDP rebuilds buckets after the first step)."""
    for _, trace in sorted(run.ranks.items()):
        layout = {int(info["index"]): info for _, _, info in trace.meta.get(schema.BUCKET, [])}
        if layout:
            return layout
    return {}


def untimed_by_cost(run: Run) -> str | None:
    """Which ranks' buckets the automatic bucket timing left to DDP because a step could not
    carry the timer (``probes/commhook.py``), with what it measured (the lowest such rank's),
    in a sentence: a run without per-bucket spans says why, and how to have them."""
    ranks, why = [], ""
    for rank, trace in sorted(run.ranks.items()):
        for _, _, info in trace.meta.get(schema.COMM_HOOK, []):
            auto = info.get("auto")
            if info.get("timed") is not False or not isinstance(auto, dict):
                continue
            ranks.append(rank)
            why = why or _why_untimed(auto)
            break
    if not ranks:
        return None
    return (
        f"gradient buckets untimed on rank {rank_list(ranks)}: {why}; "
        f"{_env.BUCKET_TIMING}=on times them anyway"
    )


def _why_untimed(auto: dict[str, Any]) -> str:
    share, step = float(auto.get("share", 0)) * 100, auto.get("step_ms")
    if "grad_mb" in auto:
        took = f"{auto['pass_us']:,.0f} µs" if auto.get("pass_us") is not None else "no room to time"
        cost = f"one more pass over its {auto['grad_mb']:g} MB of gradients ({took})"
    else:
        each = f"~{auto.get('cost_us', 0):.0f} µs each"
        cost = f"a Python comm hook on its {auto.get('buckets')} bucket(s) ({each})"
    return f"{cost} would cost more than {share:g} % of its {step:g} ms step"


def _waits(run: Run) -> tuple[np.ndarray, list[int], list[int]] | None:
    """(buckets, ranks, steps) all-reduce durations in µs over steps every rank completed
    (float32: 1,024 ranks x 10,000 steps x 4 buckets is 160 MB; NaN where a bucket is missing).
    The cube is filled rank by rank on the run's step grid, then cut to the shared steps.
    Bucket-major: a bucket's (ranks, steps) table is contiguous, so the per-step reductions
    across ranks run along rows (8 times faster than along a bucket-strided axis) and its
    median partitions one contiguous copy."""
    traces = [t for _, t in sorted(device_timed(run).ranks.items())]
    if len(traces) < 2:
        return None
    buckets = []
    for t in traces:
        b = t.kind(schema.ALLREDUCE).ints(0, default=0)
        if not len(b) or int(b.min()) < 0 or int(b.max()) >= _MAX_BUCKETS:
            return None  # a rank without bucket timings, or not a bucket index DDP writes
        buckets.append(b.astype(np.uint16))  # below _MAX_BUCKETS: 2 bytes an event, not 8
    nb = max(int(b.max()) for b in buckets) + 1
    grid = StepGrid.spanning(t.kind(schema.ALLREDUCE).step for t in traces)
    # Not filled: every rank writes the (step, bucket) cells it has, and the cells some rank
    # lacks are set to NaN for every rank below (a 160 MB fill saved at 1,024 ranks).
    n_ranks = len(traces)
    waits = np.empty((nb, n_ranks, grid.n), dtype=np.float32)
    flat = waits.reshape(-1)
    common = np.ones(grid.n * nb, bool)  # (step, bucket) that every rank has, rank by rank
    for i, (trace, bucket) in enumerate(zip(traces, buckets)):
        ar = trace.kind(schema.ALLREDUCE)
        at, durs = ar.step - grid.lo, ar.dur
        key = at * nb + bucket
        if _every_cell(key, nb):  # every bucket of a run of steps, in order: rows, not a scatter
            lo, hi = int(key[0]) // nb, int(key[-1]) // nb + 1
            waits[:, i, lo:hi] = durs.reshape(hi - lo, nb).T
            common[: lo * nb] = False
            common[hi * nb :] = False
            continue
        inside = (key >= 0) & (key < grid.n * nb)
        if not inside.all():
            at, bucket, key, durs = at[inside], bucket[inside], key[inside], durs[inside]
        seen = np.bincount(key, minlength=grid.n * nb)
        if len(key) and seen.max() > 1:  # a repeated (step, bucket): its last (a sort; rare)
            key, durs = last_per_step(key, durs)
            at, bucket = np.divmod(key, nb)
        # the cell (bucket, rank i, step) of the bucket-major cube
        flat[bucket.astype(np.intp) * (n_ranks * grid.n) + (i * grid.n + at)] = durs
        common &= seen > 0
    common = common.reshape(grid.n, nb)
    steps, cols = np.flatnonzero(common.any(axis=1)), np.flatnonzero(common.any(axis=0))
    if not len(steps):
        return None
    for b in np.flatnonzero(~common.all(axis=0)):
        waits[b][:, ~common[:, b]] = np.nan
    if len(steps) < grid.n:
        waits = waits[:, :, steps]
    if len(cols) < nb:
        waits = waits[cols]
    return waits, (steps + grid.lo).tolist(), cols.tolist()


def _every_cell(key: np.ndarray, nb: int) -> bool:
    """Whether a rank's (step, bucket) keys are every bucket of a run of grid steps, each once,
    in order: the usual rank, whose cells are slices of the cube."""
    if not len(key) or key[0] < 0 or key[0] % nb or (key[-1] + 1) % nb or key[-1] - key[0] + 1 != len(key):
        return False
    return bool(len(key) == 1 or np.diff(key).min() == 1)  # increasing by one: each key once


def exposed_comm_us(run: Run) -> tuple[float, float]:
    """(median µs per step that the backward waits after its last bucket is ready, median step µs).

    Taken on the rank that arrives last at each step: earlier ranks also wait for it, which
    is skew (a straggler), not communication.
    """
    traces = list(device_timed(run).ranks.values())
    grid = StepGrid.spanning(t.kind(schema.BACKWARD).step for t in traces)
    exposed = np.full(grid.n, np.inf)
    everywhere = np.ones(grid.n, bool)
    periods: list[np.ndarray] = []
    for trace in traces:
        ar, bwd = trace.kind(schema.ALLREDUCE), trace.kind(schema.BACKWARD)
        last_ready, has_ready = grid.put(ar.step, ar.ts, np.maximum)
        ends, has_end = grid.put(bwd.step, bwd.end)
        everywhere &= has_ready & has_end
        exposed = np.minimum(exposed, np.maximum(0, ends - last_ready))
        step_ends = last_per_step(bwd.step, bwd.end)[1]  # a step's last micro-batch ends it
        gaps = np.diff(step_ends)
        if (gaps < 0).any():  # out of order (rare): sorted first, as always
            gaps = np.diff(np.sort(step_ends))
        if len(step_ends) > 1:
            periods.append(narrow_periods(gaps))
    everywhere &= grid.steps != 0  # step 0 reduces in the constructor's bucket layout
    if not traces or not everywhere.any() or not periods:
        return 0.0, 0.0
    return float(np.median(exposed[everywhere])), median_period(periods)


def accumulates(run: Run) -> bool:
    """The job accumulates gradients: some step ran several backwards (under no_sync())."""
    for trace in run.ranks.values():
        steps = trace.kind(schema.BACKWARD).step
        if len(steps) > len(np.unique(steps)):
            return True
    return False


def bucket_stats(run: Run) -> list[dict[str, Any]]:
    """One row per bucket: bytes, parameters, median reduce time, transfer and arrival skew."""
    layout = bucket_layout(run)
    found = _waits(run)
    rows = []
    if found is None:
        return rows
    waits, _, buckets = found
    tables = [waits[j][:, 1:] if waits.shape[2] > 1 else waits[j] for j in range(len(buckets))]  # skip step 0
    # Without a missing cell (the usual run) the NaN-aware reductions are the plain ones: the
    # same values, without their NaN masks and copies of 40 MB per bucket. (Not two buckets'
    # medians at a time in threads: their two 40 MB copies took the peak past 1 GB.)
    for b, w in zip(buckets, tables, strict=True):
        nan = bool(np.isnan(w).any())
        info = layout.get(b, {})
        with warnings.catch_warnings():  # a step where no rank has this bucket stays NaN, unsaid
            warnings.simplefilter("ignore", RuntimeWarning)
            transfer = np.nanmin(w, axis=0) if nan else w.min(axis=0)
            skew = (np.nanmax(w, axis=0) if nan else w.max(axis=0)) - transfer
        median = np.nanmedian if nan else np.median
        rows.append(
            {
                "index": b,
                "bytes": info.get("bytes"),
                "params": info.get("params", []),
                "reduce_ms_p50": round(float(median(w)) / 1e3, 3),
                "transfer_ms_p50": round(float(median(transfer)) / 1e3, 3),
                "arrival_skew_ms_p50": round(float(median(skew)) / 1e3, 3),
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
        "clock": clock(run),
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
        + (
            "more micro-batches per all-reduce (the job already accumulates under no_sync()), "
            if accumulates(run)
            else "gradient accumulation with no_sync(), "
        )
        + "or a compression hook (fp16/bf16).",
        details=details,
    )
