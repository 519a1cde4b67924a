"""The column model of a rank's trace: events of one kind as packed integer columns.

A 1,024-rank run holds about 80 million events; as Python tuples or int64 columns they would
not fit, so the reader stores each integer column as the narrowest offsets that fit and each
string column as codes into a table, and analyses read whole columns at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


def distinct(values: np.ndarray, counts: bool = False, inverse: bool = False) -> Any:
    """``np.unique(values, return_counts=counts)`` (or ``return_inverse=inverse``) of an integer
    column, by counting when its values span little more than its length (steps, loader ids,
    interned string ids): the same arrays without a sort or a hash table (thousands of calls
    at 1,024 ranks)."""
    if len(values) and (values.dtype.kind == "i" or values.dtype.kind == "u" and values.dtype.itemsize < 8):
        lo = int(values.min())
        span = int(values.max()) - lo
        if span <= 4 * len(values) + 1024:
            offset = values.astype(np.intp) - lo
            n = np.bincount(offset, minlength=span + 1)
            at = np.flatnonzero(n)
            found = (at + lo).astype(values.dtype)
            if inverse:
                return found, (np.cumsum(n > 0) - 1)[offset]
            return (found, n[at]) if counts else found
    if inverse:
        return np.unique(values, return_inverse=True)
    return np.unique(values, return_counts=counts)


def count_distinct(values: np.ndarray) -> int:
    """``len(distinct(values))``: for a column in order (a rank's steps), its changes counted."""
    if len(values) > 1:
        jumps = np.diff(values)
        if jumps.min() >= 0:
            return int(np.count_nonzero(jumps)) + 1
    return len(distinct(values))


MAX_PERIOD = 16  # the longest pattern a repeating column is stored as (buckets per step)


class Packed:
    """An integer column stored as ``base`` plus the narrowest unsigned offsets that fit (or as
    codes into a small table of values): a 1,024-rank run holds about 80 million events, and
    int64 columns alone would need several GB. A column that repeats a short pattern, shifted
    by a fixed stride each time (a step per event or per bucket, a bucket index, a constant
    flag, a sequence number: ``pattern[i % p] + (i // p) * stride``) stores no array at all,
    only its pattern: a third of a training trace's bytes. A non-decreasing column whose
    every step fits a byte (a sequence number that a barrier now and then moves on by one
    more) is stored as those steps (``rising``)."""

    __slots__ = ("base", "data", "table", "n", "stride", "rising")

    def __init__(
        self,
        base: int,
        data: np.ndarray | None,
        table: np.ndarray | None = None,
        *,
        n: int = 0,
        stride: int = 0,
        rising: bool = False,
    ) -> None:
        self.base, self.data, self.table = base, data, table  # data None: ``table`` is the pattern
        self.n = len(data) if data is not None else n
        self.stride = stride
        self.rising = rising  # data: each value minus the one before (the first's is 0)

    def __getstate__(self) -> tuple:
        return self.base, self.data, self.table, self.n, self.stride, self.rising

    def __setstate__(self, state: tuple) -> None:
        self.base, self.data, table, self.n, self.stride, self.rising = state
        # An unpickled array's dtype (a worker read the trace) is a copy of int64, not numpy's
        # own: ufunc.at takes its fast path only for the latter, 25 times faster.
        self.table = None if table is None else table.view(np.int64)

    @classmethod
    def of(cls, values: np.ndarray) -> Packed:
        values = np.asarray(values, dtype=np.int64)
        if not len(values):
            return cls(0, values)
        repeating = cls._repeating(values)
        if repeating is not None:
            return repeating
        lo, hi = int(values.min()), int(values.max())
        span = hi - lo
        if span <= np.iinfo(np.uint8).max:
            return cls(lo, (values - lo).astype(np.uint8))
        rising = cls._rising(values)
        if rising is not None:
            return rising
        if span <= np.iinfo(np.uint16).max:
            return cls(lo, (values - lo).astype(np.uint16))
        head = np.unique(values[:256]) if len(values) > 256 else None
        if head is not None and len(head) <= 16:
            codes = np.searchsorted(head, values)  # the usual case: the first 256 hold every value
            if (head[np.minimum(codes, len(head) - 1)] == values).all():
                return cls(0, codes.astype(np.uint8), head)
            table, codes = np.unique(values, return_inverse=True)
            if len(table) <= 256:
                return cls(0, codes.astype(np.uint8), table)
        if span <= np.iinfo(np.uint32).max:
            return cls(lo, (values - lo).astype(np.uint32))
        return cls(0, values)

    @classmethod
    def _repeating(cls, values: np.ndarray) -> Packed | None:
        """The column as a pattern of p <= MAX_PERIOD values shifted by a stride every p events,
        when it is exactly that (its differences repeat with period p), else None. The period is
        found on the first differences, as bytes (a few µs for the columns that have none)."""
        n = len(values)
        if n < 2:
            return cls(0, None, values.copy(), n=n) if n else None
        head = np.diff(values[: 2 * MAX_PERIOD + 1]).tobytes()
        width = values.itemsize
        for p in range(1, MAX_PERIOD + 1):
            if 2 * p > n:
                return None
            if head[p * width :] == head[: len(head) - p * width]:
                stride = int(values[p]) - int(values[0])
                if (values[p:] - values[:-p] == stride).all():
                    return cls(0, None, values[:p].copy(), n=n, stride=stride)
                return None
        return None

    @classmethod
    def _rising(cls, values: np.ndarray) -> Packed | None:
        """The column as its byte-sized steps when it never decreases, else None (most columns
        are rejected on their first steps)."""
        head = np.diff(values[:65])
        if (head < 0).any() or (head > 255).any():
            return None
        steps = np.diff(values)
        if (steps < 0).any() or (steps > 255).any():
            return None
        data = np.empty(len(values), np.uint8)
        data[0], data[1:] = 0, steps
        return cls(int(values[0]), data, rising=True)

    def __len__(self) -> int:
        return self.n

    def values(self) -> np.ndarray:
        """The column as int64 (a new array)."""
        if self.data is None:
            return self._pattern_values()
        if self.table is not None:
            return self.table[self.data]
        if self.rising:
            out = np.cumsum(self.data, dtype=np.int64)
            out += self.base
            return out
        out = self.data.astype(np.int64)
        if self.base:
            out += self.base  # in place: one array, not two (160,000 calls at 1,024 ranks)
        return out

    def _pattern_values(self) -> np.ndarray:
        pattern, n, stride = self.table, self.n, self.stride
        assert pattern is not None
        p = len(pattern)
        if p == 1:
            first = int(pattern[0])
            return np.arange(first, first + n * stride, stride) if stride else np.full(n, first, np.int64)
        reps = -(-n // p)
        if not stride:
            return np.tile(pattern, reps)[:n]
        shifts = np.arange(0, reps * stride, stride)
        out = np.empty((reps, p), np.int64)
        for j in range(p):  # a strided pass per pattern value: faster than broadcasting by rows
            np.add(shifts, pattern[j], out=out[:, j])
        return out.reshape(-1)[:n]

    def item(self, i: int) -> int:
        if self.data is None or self.rising:
            if not -self.n <= i < self.n:
                raise IndexError(i)
            i %= self.n
            if self.rising:
                return self.base + int(self.data[: i + 1].sum(dtype=np.int64))  # type: ignore[index]
            p = len(self.table)  # type: ignore[arg-type]
            return int(self.table[i % p]) + (i // p) * self.stride  # type: ignore[index]
        return int(self.table[self.data[i]]) if self.table is not None else int(self.data[i]) + self.base

    def select(self, index: np.ndarray) -> Packed:
        """The values at ``index`` (an index array), as a plain column: a selection is read
        soon after and dropped (a phase's events, a ledger's tail), not worth packing again."""
        if self.data is None:
            index = np.asarray(index, dtype=np.int64)
            if len(index) and index.min() < 0:
                index = index % self.n  # from the end, as an array's
            pattern, stride = self.table, self.stride
            assert pattern is not None
            if len(pattern) == 1:
                return Packed(0, index * stride + int(pattern[0]))
            return Packed(0, pattern[index % len(pattern)] + index // len(pattern) * stride)
        if self.rising:
            return Packed(0, self._rising_values(np.asarray(index)))
        return Packed(self.base, self.data[index], self.table)

    def _rising_values(self, index: np.ndarray) -> np.ndarray:
        """``values()[index]``; for a run of positions in order (a ledger's tail), the sum of
        the steps before it and its own, not the whole column's running sum."""
        assert self.data is not None
        if (
            index.dtype.kind not in "iu"
            or len(index) < 2
            or index[0] < 0
            or index[-1] - index[0] != len(index) - 1
        ):
            return self.values()[index]
        lo, hi = int(index[0]), int(index[-1]) + 1
        if hi > self.n or (np.diff(index) != 1).any():
            return self.values()[index]
        out = np.cumsum(self.data[lo:hi], dtype=np.int64)
        out += self.base + int(self.data[:lo].sum(dtype=np.int64))
        return out


class Strings:
    """A string column as codes into a table of the distinct values (class names, op names);
    also any interned value (a list, a dict: ``schema.FIELD_TYPES`` "v")."""

    __slots__ = ("codes", "table")

    def __init__(self, codes: np.ndarray, table: list[str]) -> None:
        self.codes, self.table = codes, table

    def __len__(self) -> int:
        return len(self.codes)

    def values(self) -> np.ndarray:
        table = np.empty(len(self.table), dtype=object)  # elements may be lists: never 2-D
        table[:] = self.table
        return table[self.codes]

    def equals(self, value: Any) -> np.ndarray:
        hits = [i for i, v in enumerate(self.table) if v == value]
        return np.isin(self.codes, hits)

    def item(self, i: int) -> str:
        return self.table[self.codes[i]]

    def select(self, index: np.ndarray) -> Strings:
        return Strings(self.codes[index], self.table)


Column = Packed | Strings


class Fields(Sequence[tuple]):
    """The fields after ``step`` of every event of one kind, stored as columns: behaves as the
    list of tuples it replaces (index, iterate, len), and hands analyses whole columns."""

    __slots__ = ("columns", "n")

    def __init__(self, columns: list[Column], n: int) -> None:
        self.columns, self.n = columns, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(self)[i]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return tuple(c.item(i) for c in self.columns)

    def __iter__(self) -> Iterator[tuple]:
        if not self.columns:
            return iter([()] * self.n)
        cols = [c.values().tolist() for c in self.columns]
        return iter(zip(*cols, strict=True))

    def select(self, index: np.ndarray) -> Fields:
        return Fields([c.select(index) for c in self.columns], len(index))


class Events:
    """One kind of event on one rank, in columns: µs since the rank's clock anchor.

    ``ts``, ``dur`` and ``step`` read as int64 arrays; the reader stores them packed (see
    ``Packed``). ``fields`` is a sequence of tuples (a ``Fields`` from the reader's fast path,
    a list otherwise); ``ints``/``equals`` read one field of every event as an array, which is
    what analyses should use instead of looping over tuples.
    """

    __slots__ = ("_ts", "_dur", "_step", "fields")

    def __init__(
        self,
        ts: np.ndarray | Packed,
        dur: np.ndarray | Packed,
        step: np.ndarray | Packed,
        fields: Sequence[tuple],
    ) -> None:
        self._ts, self._dur, self._step = (
            c if isinstance(c, Packed) else np.asarray(c, dtype=np.int64) for c in (ts, dur, step)
        )
        self.fields = fields

    def __len__(self) -> int:
        return len(self._ts)

    @property
    def ts(self) -> np.ndarray:
        return self._ts.values() if isinstance(self._ts, Packed) else self._ts

    @property
    def dur(self) -> np.ndarray:
        return self._dur.values() if isinstance(self._dur, Packed) else self._dur

    @property
    def step(self) -> np.ndarray:
        return self._step.values() if isinstance(self._step, Packed) else self._step

    @property
    def end(self) -> np.ndarray:
        return self.ts + self.dur

    def ints(self, j: int, default: int = -1) -> np.ndarray:
        """Field ``j`` of every event as int64; ``default`` where it is missing or not an int."""
        if isinstance(self.fields, Fields) and j < len(self.fields.columns):
            col = self.fields.columns[j]
            if isinstance(col, Packed):
                return col.values()
            return np.full(len(self), default, np.int64)
        return np.array(
            [f[j] if len(f) > j and type(f[j]) is int else default for f in self.fields], dtype=np.int64
        ).reshape(-1)

    def equals(self, j: int, value: Any) -> np.ndarray:
        """Which events have field ``j`` equal to ``value``."""
        if isinstance(self.fields, Fields) and j < len(self.fields.columns):
            col = self.fields.columns[j]
            if isinstance(col, Strings):
                return col.equals(value)
            return col.values() == value if isinstance(value, int) else np.zeros(len(self), bool)
        return np.array([len(f) > j and f[j] == value for f in self.fields], dtype=bool).reshape(-1)

    def select(self, keep: np.ndarray) -> Events:
        """The events where ``keep`` (a boolean mask or index array) selects them."""
        index = np.flatnonzero(keep) if np.asarray(keep).dtype == bool else np.asarray(keep)
        cols = [
            c.select(index) if isinstance(c, Packed) else c[index] for c in (self._ts, self._dur, self._step)
        ]
        if isinstance(self.fields, Fields):
            fields: Sequence[tuple] = self.fields.select(index)
        else:
            fields = [self.fields[i] for i in index.tolist()]
        return Events(cols[0], cols[1], cols[2], fields)

    @classmethod
    def empty(cls) -> Events:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z.copy(), z.copy(), [])
