"""The per-bucket sync table against a plain reference, where ranks lack some bucket timings."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest

from ddpdoctor.analysis.slow.gradsync import bucket_stats
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run
from ddpdoctor.trace.simulate import simulate_run


def _drop(run: Run, rank: int, keep: np.ndarray) -> Run:
    """``run`` with only the ``keep`` mask of one rank's bucket all-reduces."""
    trace = run.ranks[rank]
    events = dict(trace.events, **{schema.ALLREDUCE: trace.kind(schema.ALLREDUCE).select(keep)})
    return replace(run, ranks={**run.ranks, rank: replace(trace, events=events)}, derived={})


def _reference(run: Run) -> list[tuple[int, float, float, float]]:
    """Per bucket (index, reduce, transfer, skew medians in ms) over the (step, bucket) cells
    every rank has, from a dict of cells; the first shared step left out (DDP's first layout)."""
    cells = {}
    for rank, trace in run.ranks.items():
        ar = trace.kind(schema.ALLREDUCE)
        for step, bucket, dur in zip(ar.step.tolist(), ar.ints(0).tolist(), ar.dur.tolist(), strict=True):
            cells[rank, step, bucket] = dur
    ranks = sorted(run.ranks)
    common = {(s, b) for (r, s, b) in cells if all((q, s, b) in cells for q in ranks)}
    steps, buckets = sorted({s for s, _ in common}), sorted({b for _, b in common})
    out = []
    for b in buckets:
        w = np.array(
            [[cells[r, s, b] if (s, b) in common else np.nan for s in steps[1:]] for r in ranks], np.float32
        )
        with warnings.catch_warnings():  # a step where no rank has the bucket
            warnings.simplefilter("ignore", RuntimeWarning)
            skew, low = np.nanmax(w, axis=0) - np.nanmin(w, axis=0), np.nanmin(w, axis=0)
        medians = (np.nanmedian(w), np.nanmedian(low), np.nanmedian(skew))
        out.append((b, *(round(float(m) / 1e3, 3) for m in medians)))
    return out


def test_bucket_stats_count_only_the_cells_every_rank_has(recwarn: pytest.WarningsRecorder) -> None:
    run = simulate_run(world=3, steps=12, seed=3)
    ar = run.ranks[1].kind(schema.ALLREDUCE)
    run = _drop(run, 1, ~((ar.step == 4) & (ar.ints(0) == 1)))  # one bucket of one step
    run = _drop(run, 2, run.ranks[2].kind(schema.ALLREDUCE).step != 7)  # a whole step
    rows = bucket_stats(run)
    got = [(r["index"], r["reduce_ms_p50"], r["transfer_ms_p50"], r["arrival_skew_ms_p50"]) for r in rows]
    assert got == _reference(run)
    assert len(got) == 3
    assert not recwarn.list, "a step where no rank has a bucket is no warning to print"
