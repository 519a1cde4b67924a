"""Per-step reductions: the sort-free path for traces in step order equals the general one."""

from __future__ import annotations

import numpy as np
import pytest

from ddpdoctor.analysis.phases import StepGrid, last_per_step, percentiles, reduce_per_step


@pytest.mark.parametrize("in_order", [True, False])
def test_per_step_reductions_match_a_sorting_reference(in_order: bool) -> None:
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 60))
        step = rng.integers(0, 12, n)
        if in_order:
            step = np.sort(step)
        values = rng.integers(0, 1000, n)
        order = np.argsort(step, kind="stable")
        steps, first = np.unique(step[order], return_index=True)
        for ufunc in (np.add, np.maximum, np.minimum):
            got = reduce_per_step(step, values, ufunc)
            assert np.array_equal(got[0], steps)
            assert np.array_equal(got[1], ufunc.reduceat(values[order], first))
        last = {int(s): int(v) for s, v in zip(step, values, strict=True)}  # a dict keeps the last
        got_steps, got_last = last_per_step(step, values)
        assert got_steps.tolist() == sorted(last)
        assert got_last.tolist() == [last[s] for s in sorted(last)]


def test_percentiles_match_numpy() -> None:
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 7, 20, 101, 1000):
        values = rng.integers(0, 10**9, n)
        assert np.allclose(percentiles(values, (0, 50, 95, 100)), np.percentile(values, [0, 50, 95, 100]))


def test_step_grid_put_matches_per_step_reductions() -> None:
    rng = np.random.default_rng(2)
    for _ in range(300):
        n = int(rng.integers(0, 40))
        step = rng.integers(-2, 15, n)
        values = rng.integers(0, 10**12, n)
        grid = StepGrid(int(rng.integers(0, 3)), int(rng.integers(1, 12)))
        for ufunc in (None, np.add, np.maximum, np.minimum):
            got, present = grid.put(step, values, ufunc)
            steps, want = (
                last_per_step(step, values) if ufunc is None else reduce_per_step(step, values, ufunc)
            )
            expect, expect_present = np.zeros(grid.n), np.zeros(grid.n, bool)
            for s, v in zip(steps.tolist(), want.tolist()):
                if grid.lo <= s < grid.lo + grid.n:
                    expect[s - grid.lo], expect_present[s - grid.lo] = v, True
            assert np.array_equal(present, expect_present)
            assert np.array_equal(got, expect)
