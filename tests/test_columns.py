"""Packed columns: whatever form a column is stored in (offsets, a value table, a repeating
pattern, byte-sized rises), it must read back as exactly the values it was given, by whole
column, by item, by selection and after the trip through a read worker's pickle."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from ddpdoctor.trace.columns import MAX_PERIOD, Packed, count_distinct


def _columns() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    n = 5_000
    pattern = rng.integers(-50, 50, 7)
    return {
        "empty": np.zeros(0, np.int64),
        "one": np.array([42]),
        "two": np.array([5, -3]),
        "three": np.array([1, 2, 1]),
        "constant": np.full(n, -7),
        "arithmetic": np.arange(n) * 3 + 10**12,
        "steps per bucket": np.repeat(np.arange(n // 4), 4),
        "pattern with stride": np.tile(pattern, n // 7) + np.repeat(np.arange(n // 7), 7) * 1000,
        "pattern without stride": np.tile(pattern, n // 7),
        "longest pattern": np.tile(np.arange(MAX_PERIOD) ** 2, 40),
        "pattern broken at the end": np.append(np.tile(pattern, 100), 10**9),
        "rising by bytes": np.cumsum(rng.integers(0, 256, n)) + 2**40,
        "rising with a wide step": np.append(np.arange(300), 10**6),
        "falling once": np.append(np.arange(300), 5),
        "noise": rng.integers(-(2**40), 2**40, n),
        "few values": rng.choice([3, 99, 10**10], n),
    }


@pytest.mark.parametrize("name", list(_columns()))
def test_every_packed_form_reads_back_exactly(name: str) -> None:
    values = _columns()[name].astype(np.int64)
    col = Packed.of(values)
    again = pickle.loads(pickle.dumps(col))  # the read workers send columns so
    for packed in (col, again):
        assert len(packed) == len(values)
        assert np.array_equal(packed.values(), values)
        assert packed.values().dtype == np.int64
        for i in {0, 1, len(values) // 2, len(values) - 1, -1, -len(values)} if len(values) else ():
            if -len(values) <= i < len(values):
                assert packed.item(i) == int(values[i])
        with pytest.raises(IndexError):
            packed.item(len(values))
        rng = np.random.default_rng(len(values))
        index = rng.integers(-len(values), len(values), 300) if len(values) else np.zeros(0, np.int64)
        assert np.array_equal(packed.select(index).values(), values[index])
        mask = np.zeros(len(values), bool)
        mask[::3] = True
        assert np.array_equal(packed.select(np.flatnonzero(mask)).values(), values[mask])


def test_regular_columns_are_stored_without_an_array_per_event() -> None:
    """What the memory target rests on: a training trace's steps, bucket indices and sequence
    numbers cost (next to) nothing per event, and nothing irregular is mistaken for them."""
    cols = _columns()
    for name in ("constant", "arithmetic", "steps per bucket", "pattern with stride", "longest pattern"):
        assert Packed.of(cols[name]).data is None, name
    assert Packed.of(cols["rising by bytes"]).rising
    for name in ("pattern broken at the end", "noise", "falling once", "rising with a wide step"):
        packed = Packed.of(cols[name])
        assert packed.data is not None and not packed.rising, name


@pytest.mark.parametrize(
    "index",
    [
        np.arange(40_000 - 128, 40_000),  # a ledger's tail: summed from the steps before it
        np.arange(0, 40_000),
        np.arange(7, 8),
        np.arange(5, 9, dtype=np.int32),
        np.arange(-5, 0),  # from the end, as an array's
        np.arange(3, 10, 2),
        np.array([39_999, 0]),
        np.zeros(0, np.int64),
    ],
)
def test_a_rising_columns_selection_reads_its_values(index: np.ndarray) -> None:
    values = np.cumsum(np.random.default_rng(0).integers(0, 5, 40_000)) + 12_345
    col = Packed.of(values)
    assert col.rising
    got = col.select(index).values()
    assert got.dtype == np.int64 and got.tolist() == values[index].tolist()


@pytest.mark.parametrize("name", list(_columns()))
def test_count_distinct_is_the_number_of_distinct_values(name: str) -> None:
    """Counted from the changes where a column is in order (a rank's steps), else by counting
    values: the same number either way."""
    values = _columns()[name]
    assert count_distinct(values) == len(np.unique(values))
    assert count_distinct(np.sort(values)) == len(np.unique(values))
