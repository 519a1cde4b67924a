"""Per-step reductions and the step grid against plain-Python references."""

from __future__ import annotations

from functools import reduce

import numpy as np
import pytest

from ddpdoctor.analysis.slow.phases import StepGrid, first_per_step, last_per_step, percentiles


@pytest.mark.parametrize("order", ["runs", "shuffled", "one per step"])
def test_first_and_last_per_step_match_a_dict(order: str) -> None:
    """The sort-free paths (a trace in step order; an event per step, nothing to pick) and the
    general one."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 60))
        step = rng.integers(0, 12, n)
        if order == "runs":
            step = np.sort(step)
        elif order == "one per step":
            step = np.sort(rng.choice(100, n, replace=False))
        values = rng.integers(0, 1000, n)
        last = {int(s): int(v) for s, v in zip(step, values, strict=True)}  # a dict keeps the last
        first = {int(s): int(v) for s, v in reversed(list(zip(step, values, strict=True)))}
        for func, want in ((last_per_step, last), (first_per_step, first)):
            got_steps, got = func(step, values)
            assert got_steps.tolist() == sorted(want)
            assert got.tolist() == [want[s] for s in sorted(want)]


def test_percentiles_match_numpy() -> None:
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 7, 20, 101, 1000):
        values = rng.integers(0, 10**9, n)
        assert np.allclose(percentiles(values, (0, 50, 95, 100)), np.percentile(values, [0, 50, 95, 100]))


def test_step_grid_put_matches_a_python_reduction() -> None:
    """Every path of ``put``: in step order or not, one event per step or runs, gaps, steps
    outside the grid; the last value, a sum, a max, a min."""
    rng = np.random.default_rng(2)
    combine = {None: lambda a, b: b, np.add: lambda a, b: a + b, np.maximum: max, np.minimum: min}
    for _ in range(300):
        n = int(rng.integers(0, 40))
        step = rng.integers(-2, 15, n)
        order = rng.random()
        if order < 0.33:  # runs of equal steps in order: reduced run by run
            step = np.sort(step)
        elif order < 0.66:  # an event per step, in order, with or without gaps
            step = np.sort(rng.choice(np.arange(-2, 15), min(n, 17), replace=False))
            n = len(step)
        values = rng.integers(0, 10**12, n)
        grid = StepGrid(int(rng.integers(0, 3)), int(rng.integers(1, 12)))
        for ufunc, op in combine.items():
            got, present = grid.put(step, values, ufunc)
            expect, expect_present = np.zeros(grid.n), np.zeros(grid.n, bool)
            for s in range(grid.lo, grid.lo + grid.n):
                mine = values[step == s].tolist()
                if mine:
                    expect[s - grid.lo], expect_present[s - grid.lo] = reduce(op, mine), True
            assert np.array_equal(present, expect_present)
            assert np.array_equal(got, expect)


def test_runs_of_one_length_reduce_as_reduceat_would() -> None:
    """A step's buckets (runs of equal steps, all of one length) take a strided pass instead of
    a reduceat: the same steps, values and dtype as the general path, whatever the steps."""
    from ddpdoctor.analysis.slow.phases import _EVERY, _reduce_runs, _runs

    rng = np.random.default_rng(0)
    for t in range(3000):
        n, p = int(rng.integers(0, 40)), int(rng.integers(1, 5))
        step = [
            np.repeat(np.sort(rng.integers(0, 10, n // p)), p),
            np.repeat(np.arange(n // p) + 3, p),
            np.sort(rng.integers(0, 8, n)),
            rng.integers(0, 5, n),
        ][t % 4]
        if t % 3 == 0 and len(step):
            step[rng.integers(0, len(step))] += rng.integers(-1, 2)
        values = rng.normal(size=len(step)) if t % 2 else rng.integers(-9, 9, len(step))
        jumps = np.diff(step)
        starts = _runs(step)
        if not len(step) or jumps.min(initial=1) < 0:
            assert starts is None
        elif jumps.min(initial=1) > 0:
            assert starts is _EVERY
        else:
            expected = np.concatenate(([0], np.flatnonzero(jumps) + 1))
            assert np.array_equal(starts, expected)
            for ufunc in (np.maximum, np.minimum):
                steps, reduced, one_each = _reduce_runs(step, values, ufunc)
                assert one_each and np.array_equal(steps, step[expected])
                assert np.array_equal(reduced, ufunc.reduceat(values, expected))
                assert reduced.dtype == values.dtype
