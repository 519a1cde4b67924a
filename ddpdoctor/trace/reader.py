"""Tolerant reader of run directories: rank traces plus the supervisor's ``run.json``.

A line that is truncated (a rank killed mid-write) or corrupt is skipped and counted, never
fatal. Nothing read from a trace is ever executed or unpickled: it is JSON, and only JSON.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddpdoctor.trace import schema

RUN_META = "run.json"
_TRACE_NAME = re.compile(r"^trace-rank(\d+)(?:-attempt(\d+))?\.jsonl$")


class TraceError(Exception):
    """A run directory that cannot be read at all (missing, or holding no trace)."""


class Packed:
    """An integer column stored as ``base`` plus the narrowest unsigned offsets that fit (or as
    codes into a small table of values): a 1,024-rank run holds about 80 million events, and
    int64 columns alone would need several GB."""

    __slots__ = ("base", "data", "table")

    def __init__(self, base: int, data: np.ndarray, table: np.ndarray | None = None) -> None:
        self.base, self.data, self.table = base, data, table

    @classmethod
    def of(cls, values: np.ndarray) -> Packed:
        values = np.asarray(values, dtype=np.int64)
        if not len(values):
            return cls(0, values)
        lo, hi = int(values.min()), int(values.max())
        span = hi - lo
        for dtype in (np.uint8, np.uint16):
            if span <= np.iinfo(dtype).max:
                return cls(lo, (values - lo).astype(dtype))
        if len(values) > 256 and len(np.unique(values[:256])) <= 16:
            table, codes = np.unique(values, return_inverse=True)
            if len(table) <= 256:
                return cls(0, codes.astype(np.uint8), table)
        if span <= np.iinfo(np.uint32).max:
            return cls(lo, (values - lo).astype(np.uint32))
        return cls(0, values)

    def __len__(self) -> int:
        return len(self.data)

    def values(self) -> np.ndarray:
        """The column as int64 (a new array)."""
        if self.table is not None:
            return self.table[self.data]
        return self.data.astype(np.int64) + self.base

    def item(self, i: int) -> int:
        return int(self.table[self.data[i]]) if self.table is not None else int(self.data[i]) + self.base

    def select(self, index: np.ndarray) -> Packed:
        return Packed(self.base, self.data[index], self.table)


class Strings:
    """A string column as codes into a table of the distinct values (class names, op names)."""

    __slots__ = ("codes", "table")

    def __init__(self, codes: np.ndarray, table: list[str]) -> None:
        self.codes, self.table = codes, table

    def __len__(self) -> int:
        return len(self.codes)

    def values(self) -> np.ndarray:
        return np.array(self.table, dtype=object)[self.codes] if self.table else np.zeros(0, object)

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


@dataclass
class RankTrace:
    """Everything one rank recorded."""

    rank: int
    header: dict[str, Any]
    path: Path
    events: dict[str, Events]
    meta: dict[str, list[tuple[int, int, dict[str, Any]]]]  # kind -> [(ts, step, info)]
    skipped_lines: int = 0

    @property
    def host(self) -> str:
        return str(self.header.get("host", "?"))

    @property
    def ended_cleanly(self) -> bool:
        return bool(self.meta.get(schema.END))

    @property
    def last_ts(self) -> int:
        """The latest timestamp this rank wrote (µs), or 0."""
        ends = [int(ev.end.max()) for ev in self.events.values() if len(ev)]
        ends += [records[-1][0] for records in self.meta.values() if records]
        return max(ends, default=0)

    def kind(self, kind: str) -> Events:
        return self.events.get(kind) or Events.empty()

    @property
    def steps(self) -> int:
        """Training steps: DDP forwards in grad mode."""
        return int((self.kind(schema.FORWARD).ints(0) == 1).sum())

    def wall_offset_us(self) -> int:
        """Add to this rank's timestamps to get its own wall-clock µs since the epoch."""
        return int(self.header["wall_ns"]) // 1000

    def clock_offset_us(self) -> int | None:
        """Add to this rank's wall clock to get rank 0's (its ``clock`` record), None if unmeasured."""
        for _ts, _step, info in self.meta.get(schema.CLOCK, []):
            if isinstance(info.get("offset_ns"), int):
                return int(info["offset_ns"]) // 1000
        return None


def read_trace(path: Path) -> RankTrace:
    """Parse one rank's trace file; raises TraceError only when it has no readable header.

    The common event lines (integers and plain strings only) are parsed in bulk with numpy;
    every other line (header, metadata, anything unusual or damaged) goes through ``json``
    one by one, and a line that is not valid JSON or not a record is skipped and counted.
    """
    data = Path(path).read_bytes()
    fast, slow = _parse_fast(data)
    header: dict[str, Any] | None = None
    skipped = 0
    columns: dict[str, tuple[list[int], list[int], list[int], list[int], list[tuple]]] = {}
    meta: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for line_no, raw in slow:
        try:
            rec = json.loads(raw)
        except ValueError:
            rec = None
        if not isinstance(rec, list) or not rec or not isinstance(rec[0], str):
            skipped += 1
            continue
        kind = rec[0]
        if kind == schema.HEADER:
            if header is None and len(rec) > 1 and isinstance(rec[1], dict):
                header = rec[1]
            continue
        if len(rec) < 4 or not all(isinstance(v, int) and -_I64 <= v < _I64 for v in rec[1:4]):
            skipped += 1
            continue
        if len(rec) == 5 and isinstance(rec[4], dict) and kind not in _EVENT_KINDS:
            meta.setdefault(kind, []).append((rec[1], rec[3], rec[4]))
            continue
        cols = columns.get(kind)
        if cols is None:
            cols = columns[kind] = ([], [], [], [], [])
        for col, value in zip(cols, (line_no, rec[1], rec[2], rec[3], tuple(rec[4:])), strict=True):
            col.append(value)
    if header is None or "rank" not in header:
        raise TraceError(f"{path}: no trace header")
    events: dict[str, Events] = {}
    for kind in sorted(set(fast) | set(columns)):
        if kind not in columns:
            _, ts, dur, step, fields = fast[kind]
            events[kind] = Events(Packed.of(ts), Packed.of(dur), Packed.of(step), fields)
            continue
        lines, ts_l, dur_l, step_l, tuples = columns[kind]
        if kind in fast:  # some lines of a bulk-parsed kind were unusual: merge in file order
            f_lines, f_ts, f_dur, f_step, f_fields = fast[kind]
            lines = f_lines.tolist() + lines
            ts_l, dur_l, step_l = f_ts.tolist() + ts_l, f_dur.tolist() + dur_l, f_step.tolist() + step_l
            tuples = list(f_fields) + tuples
        order = np.argsort(np.asarray(lines), kind="stable")
        events[kind] = Events(
            Packed.of(np.asarray(ts_l, dtype=np.int64)[order]),
            Packed.of(np.asarray(dur_l, dtype=np.int64)[order]),
            Packed.of(np.asarray(step_l, dtype=np.int64)[order]),
            [tuples[i] for i in order.tolist()],
        )
    return RankTrace(int(header["rank"]), header, path, events, meta, skipped)


# Kinds the bulk parser handles: their fields after ``step``, "i" an integer, "s" a string.
_FAST_KINDS: dict[str, str] = {
    schema.DATA_WAIT: "i",
    schema.FORWARD: "iii",  # grad mode, module.training, seq
    schema.SYNC_BUFFERS: "i",
    schema.BACKWARD: "",
    schema.ALLREDUCE: "iii",
    schema.COLLECTIVE: "sisiii",
    schema.OPTIMIZER: "s",
    schema.GRAPH_SCAN: "",
    schema.DEV_FORWARD: "iii",  # device spans: the fields of their CPU twins
    schema.DEV_BACKWARD: "",
    schema.DEV_ALLREDUCE: "iii",  # (dev_optimizer: its line prefix is over 16 bytes; one a step)
}
_I64 = 2**63
_MAX_DIGITS = 16  # two 8-byte chunks; longer integers (never written) go through json
_MAX_STRING = 64  # longer strings too
_PAD = _MAX_STRING + 32  # room to read a whole token, or 16 bytes, past any line's end

FastKind = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Fields]


def _parse_fast(data: bytes) -> tuple[dict[str, FastKind], list[tuple[int, bytes]]]:
    """Bulk-parse the lines of the kinds in ``_FAST_KINDS`` that have exactly their shape
    (compact JSON, integers and escape-free strings); every other line is returned, with its
    index, for the careful path. Per kind: (line indices, ts, dur, step, Fields).

    Each line is classified once by its first 16 bytes (two little-endian words), and commas
    are counted once per file; the tokens between them are then parsed column by column."""
    a = np.frombuffer(data, dtype=np.uint8)
    nl = np.flatnonzero(a == 10)
    starts = np.concatenate(([0], nl + 1))
    ends = np.concatenate((nl, [len(a)]))
    if ends[-1] == starts[-1]:  # the file ends with a newline: no last line
        starts, ends = starts[:-1], ends[:-1]
    done = np.zeros(len(starts), dtype=bool)
    out: dict[str, FastKind] = {}
    if len(starts):
        file = _File.of(a, starts, ends)
        for kind, spec in _FAST_KINDS.items():
            found = file.parse_kind(kind, "iii" + spec)
            if found is None:
                continue
            lines, cols = found
            done[lines] = True
            fields = Fields([c if isinstance(c, Strings) else Packed.of(c) for c in cols[3:]], len(lines))
            out[kind] = (lines, cols[0], cols[1], cols[2], fields)
    slow = [(int(i), data[starts[i] : ends[i]]) for i in np.flatnonzero(~done)]
    return out, [(i, raw) for i, raw in slow if raw.strip()]


@dataclass
class _File:
    """One trace file's bytes and line/comma positions, as the bulk parser needs them."""

    a: np.ndarray  # the bytes, padded with zeros
    words: np.ndarray  # words[i]: bytes i..i+7 as a little-endian uint64
    starts: np.ndarray
    ends: np.ndarray
    head: np.ndarray  # per line: its first 8 bytes as a word
    commas: np.ndarray
    first_comma: np.ndarray  # per line: index in ``commas`` of its first comma
    n_commas: np.ndarray  # per line
    quotes: np.ndarray
    backslashes: np.ndarray

    @classmethod
    def of(cls, a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> _File:
        padded = np.concatenate((a, np.zeros(_PAD, np.uint8)))
        # Every byte offset's next 8 bytes as one little-endian word (a view, nothing copied).
        words = np.lib.stride_tricks.as_strided(padded, (len(padded) - 7, 8), (1, 1)).view("<u8")[:, 0]
        commas = np.flatnonzero(a == 44)
        first_comma = np.searchsorted(commas, starts)
        n_commas = np.diff(np.append(first_comma, len(commas)))
        quotes, backslashes = np.flatnonzero(a == 34), np.flatnonzero(a == 92)
        head = words[starts]
        return cls(padded, words, starts, ends, head, commas, first_comma, n_commas, quotes, backslashes)

    def parse_kind(self, kind: str, spec: str) -> tuple[np.ndarray, list[Any]] | None:
        """The lines that are exactly ``["kind",tok,...]`` with tokens as ``spec`` says, parsed:
        (line indices, [int64 array per "i" token, Strings per "s" token])."""
        prefix = f'["{kind}",'.encode()
        word0, (word1, mask1) = _prefix_words(prefix)
        cand = np.flatnonzero(self.head == word0)
        if not len(cand):
            return None
        starts, ends = self.starts[cand], self.ends[cand]
        ok = (
            ((self.words[starts + 8] & mask1) == word1)
            & (ends - starts > len(prefix) + 1)
            & (self.a[ends - 1] == 93)  # "]"
            & (self.n_commas[cand] == len(spec))  # the prefix's comma and one between tokens
        )
        n_str = spec.count("s")
        if n_str:  # quotes and backslashes only matter inside strings (an int rejects them)
            ok &= _count(self.quotes, starts, ends) == 2 + 2 * n_str
            if len(self.backslashes):
                ok &= _count(self.backslashes, starts, ends) == 0
        cand, starts, ends = cand[ok], starts[ok], ends[ok]
        if not len(cand):
            return None
        first = self.first_comma[cand]  # the prefix's comma; then one after each token
        lo = self.commas[first] + 1
        good = np.ones(len(cand), dtype=bool)
        parsed: list[Any] = []
        for j, t in enumerate(spec):
            hi = self.commas[first + j + 1] if j + 1 < len(spec) else ends - 1
            values, valid = _ints(self.a, self.words, lo, hi) if t == "i" else _strings(self.a, lo, hi)
            parsed.append(values)
            good &= valid
            lo = hi + 1
        if not good.any():
            return None
        cols: list[Any] = []
        for p in parsed:
            if isinstance(p, tuple):
                codes, table = p
                cols.append(_strings_column(codes[good], table))
            else:
                cols.append(p[good])
        return cand[good], cols


def _prefix_words(prefix: bytes) -> tuple[int, tuple[int, int]]:
    """A line prefix of 9-16 bytes as (its first word, (its second word, the mask of its bytes))."""
    assert 8 < len(prefix) <= 16, prefix
    rest = prefix[8:]
    mask = (1 << (8 * len(rest))) - 1
    return int.from_bytes(prefix[:8], "little"), (int.from_bytes(rest, "little"), mask)


def _count(pos: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """How many of the sorted positions ``pos`` lie in each [lo, hi)."""
    return np.searchsorted(pos, hi) - np.searchsorted(pos, lo)


def _strings_column(codes: np.ndarray, table: list[str]) -> Strings:
    if len(table) == 1:
        return Strings(np.zeros(len(codes), np.uint8), table)
    used, codes = np.unique(codes, return_inverse=True)  # drop values only bad lines had
    kept = [table[i] for i in used.tolist()]
    return Strings(codes.reshape(-1).astype(np.uint8 if len(kept) <= 256 else np.uint32), kept)


_ZEROS = np.uint64(0x3030303030303030)  # eight ASCII "0"
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_SIXES = np.uint64(0x0606060606060606)
# _BELOW[n]: the low 8 - n bytes of a word, which lie before a token of n digits ending at its top.
_BELOW = np.array([(1 << (8 * (8 - n))) - 1 for n in range(9)], dtype=np.uint64)


def _ints(a: np.ndarray, words: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integer tokens a[lo:hi] -> (int64 values, which were well-formed JSON integers).

    Eight digits at a time: the 8 bytes ending at a token's end are one little-endian word,
    bytes before the token's start are replaced by "0", and three multiply-shift steps turn
    the eight ASCII digits into their value (SWAR). A token of 9-16 digits takes two words."""
    first = a[lo]
    neg = first == 45  # "-"
    signed = bool(neg.any())
    if signed:
        lo = lo + neg
        first = a[lo]
    length = hi - lo  # >= 0
    valid = ((length - 1).view(np.uint64) < _MAX_DIGITS) & ((first != 48) | (length == 1))  # no leading 0
    length = np.minimum(length, _MAX_DIGITS)
    low_len = np.minimum(length, 8)
    values, ok = _eight_digits(words[hi - 8], low_len)
    valid &= ok
    if int(length.max(initial=0)) > 8:
        high_len = length - low_len
        high, ok = _eight_digits(words[np.maximum(hi - 16, 0)], high_len)
        valid &= ok | (high_len == 0)
        values += high * 100_000_000  # 0 where there is no high part
    values = values.view(np.int64)  # below 10**16: the same bits
    return (np.where(neg, -values, values) if signed else values), valid


def _eight_digits(word: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value of the top ``n`` bytes of each word as decimal digits, whether they all are)."""
    below = _BELOW[n]
    word = (word & ~below) | (_ZEROS & below)
    ok = ((word & _HIGH_NIBBLES) == _ZEROS) & (((word + _SIXES) & _HIGH_NIBBLES) == _ZEROS)
    d = word - _ZEROS
    d = ((d * np.uint64(10)) + (d >> np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
    d = ((d * np.uint64(100)) + (d >> np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
    d = (d * np.uint64(10000)) + (d >> np.uint64(32))
    return d & np.uint64(0xFFFFFFFF), ok


def _strings(
    a: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[tuple[np.ndarray, list[str]], np.ndarray]:
    """String tokens a[lo:hi] (with their quotes) -> ((codes, distinct values), well-formed)."""
    length = hi - lo - 2
    valid = (length >= 0) & (length <= _MAX_STRING) & (a[lo] == 34) & (a[np.maximum(hi - 1, lo)] == 34)
    length = np.where(valid, length, 0)
    width = int(length.max()) if len(length) else 0
    pos = np.arange(width)
    chars = np.where(pos < length[:, None], a[lo[:, None] + 1 + pos], 0).astype(np.uint8)
    key = np.concatenate((length[:, None].astype(np.uint8), chars), axis=1)
    if (key == key[0]).all():  # the usual case: one class name, one op
        rows, codes = key[:1], np.zeros(len(key), dtype=np.int64)
    else:
        rows, codes = np.unique(key, axis=0, return_inverse=True)
    table = [bytes(row[1 : 1 + row[0]]).decode("utf-8", "replace") for row in rows]
    return (codes.reshape(-1), table), valid


_EVENT_KINDS = frozenset(
    {
        schema.DDP_INIT,
        schema.FORWARD,
        schema.SYNC_BUFFERS,
        schema.BACKWARD,
        schema.ALLREDUCE,
        schema.COLLECTIVE,
        schema.DATA_WAIT,
        schema.OPTIMIZER,
        schema.GRAPH_SCAN,
        *schema.DEVICE_KINDS.values(),
    }
)


@dataclass
class GpuTrace:
    """One node's NVML samples (``gpu-<host>.jsonl``), as the supervisor wrote them."""

    host: str
    header: dict[str, Any]
    path: Path
    samples: list[tuple[int, dict[str, Any]]]  # (ts µs since the header's mono_ns, gpu record)
    procs: list[tuple[int, dict[str, Any]]]  # (ts, gpu_procs record)
    meta: dict[str, list[tuple[int, dict[str, Any]]]]  # other kinds: unavailable, unsupported...
    skipped_lines: int = 0


def _records(path: Path) -> list[Any]:
    """Every line's JSON value, None for a corrupt one. The whole file parses as one array in a
    single call when it is intact (ten times faster than line by line: large runs), and line by
    line only when that fails."""
    data = Path(path).read_bytes()
    body = data.rstrip(b"\n")
    if body:
        try:
            return json.loads(b"[" + body.replace(b"\n", b",") + b"]")
        except ValueError:
            pass
    out: list[Any] = []
    for raw in data.splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            out.append(None)
    return out


def read_gpu(path: Path) -> GpuTrace:
    """Parse one node's GPU samples; raises TraceError only when it has no readable header."""
    header: dict[str, Any] | None = None
    samples: list[tuple[int, dict[str, Any]]] = []
    procs: list[tuple[int, dict[str, Any]]] = []
    meta: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    skipped = 0
    for rec in _records(path):
        if not isinstance(rec, list) or len(rec) < 2 or not isinstance(rec[0], str):
            skipped += 1
            continue
        if rec[0] == schema.HEADER:
            if header is None and isinstance(rec[1], dict):
                header = rec[1]
            continue
        if len(rec) != 5 or not isinstance(rec[1], int) or not isinstance(rec[4], dict):
            skipped += 1
            continue
        if rec[0] == schema.GPU and isinstance(rec[4].get("gpu"), int):
            samples.append((rec[1], rec[4]))
        elif rec[0] == schema.GPU_PROCS and isinstance(rec[4].get("gpu"), int):
            procs.append((rec[1], rec[4]))
        else:
            meta.setdefault(rec[0], []).append((rec[1], rec[4]))
    if header is None or header.get("schema") != schema.GPU_SCHEMA:
        raise TraceError(f"{path}: no GPU sample header")
    return GpuTrace(str(header.get("host", "?")), header, path, samples, procs, meta, skipped)


@dataclass
class Run:
    """Every rank of one job, from one or more run directories (one per node)."""

    dirs: list[Path]
    metas: list[dict[str, Any]]
    ranks: dict[int, RankTrace]
    notes: list[str] = field(default_factory=list)
    hangs: list[dict[str, Any]] = field(default_factory=list)  # hang-N/summary.json (`run` watch)
    watches: list[dict[str, Any]] = field(default_factory=list)  # watch.json, one per run dir
    gpus: list[GpuTrace] = field(default_factory=list)  # gpu-<host>.jsonl, one per node

    @property
    def world_size(self) -> int:
        sizes = [int(t.header.get("world_size", 0)) for t in self.ranks.values()]
        return max(sizes + [len(self.ranks)])

    @property
    def hosts(self) -> list[str]:
        return sorted({t.host for t in self.ranks.values()})

    @property
    def command(self) -> list[str]:
        for meta in self.metas:
            if meta.get("command"):
                return list(meta["command"])
        return []

    @property
    def exit_code(self) -> int | None:
        """The first non-zero exit code among the nodes, 0 if all succeeded, None if unknown."""
        codes = [m.get("exit_code") for m in self.metas if m.get("exit_code") is not None]
        if not codes:
            return None
        return next((int(c) for c in codes if c != 0), 0)

    @property
    def skipped_lines(self) -> int:
        return sum(t.skipped_lines for t in self.ranks.values())

    def offset_us(self, rank: int) -> int:
        """Add to a rank's timestamps to place them on the run's common time base: rank 0's
        wall clock, through each rank's measured clock offset (its own wall clock if none)."""
        trace = self.ranks[rank]
        return trace.wall_offset_us() + (trace.clock_offset_us() or 0)


def _trace_files(run_dir: Path) -> dict[int, Path]:
    """The newest attempt's trace of each rank in one directory (regular files only: a trace
    name pointing at a device such as /dev/full or a FIFO would never end)."""
    best: dict[int, tuple[int, Path]] = {}
    for path in run_dir.glob(schema.TRACE_GLOB):
        match = _TRACE_NAME.match(path.name)
        if not match or not path.is_file():
            continue
        rank, attempt = int(match.group(1)), int(match.group(2) or 0)
        if rank not in best or attempt > best[rank][0]:
            best[rank] = (attempt, path)
    return {rank: path for rank, (_, path) in best.items()}


def read_meta(run_dir: Path) -> dict[str, Any]:
    """The supervisor's run.json, or {} when the job was instrumented without `ddpdoctor run`."""
    try:
        meta = json.loads((run_dir / RUN_META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def load_run(dirs: Iterable[str | Path]) -> Run:
    """Read one or more run directories into one Run; raises TraceError if none holds a trace."""
    paths = [Path(d) for d in dirs]
    ranks: dict[int, RankTrace] = {}
    metas: list[dict[str, Any]] = []
    notes: list[str] = []
    for run_dir in paths:
        if not run_dir.is_dir():
            raise TraceError(f"{run_dir}: not a directory")
        metas.append(read_meta(run_dir))
    files = [(rank, path) for run_dir in paths for rank, path in sorted(_trace_files(run_dir).items())]
    for (rank, path), trace in zip(files, _read_all([p for _, p in files]), strict=True):
        if isinstance(trace, str):
            notes.append(trace)
            continue
        if rank in ranks:
            notes.append(f"rank {rank} appears in {ranks[rank].path} and {path}; using the latter")
        ranks[rank] = trace
    if not ranks:
        where = ", ".join(str(p) for p in paths)
        raise TraceError(f"no rank traces in {where}" + (f" ({'; '.join(notes)})" if notes else ""))
    skipped = sum(t.skipped_lines for t in ranks.values())
    if skipped:
        notes.append(f"skipped {skipped} truncated or corrupt trace line(s)")
    hangs: list[dict[str, Any]] = []
    watches: list[dict[str, Any]] = []
    for run_dir in paths:
        for path in sorted(run_dir.glob("hang-*/summary.json"), key=lambda p: len(str(p))):
            hangs.extend(_json_object(path))
        watches.extend(_json_object(run_dir / "watch.json"))
    return Run(paths, metas, ranks, notes, hangs, watches, _gpu_traces(paths, notes))


def _gpu_traces(paths: list[Path], notes: list[str]) -> list[GpuTrace]:
    """Every node's GPU samples; an unreadable file is a note, never an error."""
    out: list[GpuTrace] = []
    for run_dir in paths:
        for path in sorted(run_dir.glob(schema.GPU_GLOB)):
            try:
                out.append(read_gpu(path))
            except (TraceError, OSError) as exc:
                notes.append(str(exc))
    return out


def _read_one(path: Path) -> RankTrace | str:
    """A rank's trace, or why it cannot be read (a note)."""
    try:
        return read_trace(path)
    except TraceError as exc:
        return str(exc)
    except OSError as exc:
        return f"{path}: {exc.strerror}"


def read_workers(files: int) -> int:
    """Processes to read rank files with: the usable cores (``DDPDOCTOR_READ_WORKERS``
    overrides), and 1 for small runs, where starting workers costs more than it saves."""
    env = os.environ.get("DDPDOCTOR_READ_WORKERS", "")
    cores = int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))
    return max(1, min(cores, files // PARALLEL_MIN_FILES))


PARALLEL_MIN_FILES = 16


def _read_all(files: list[Path]) -> Iterator[RankTrace | str]:
    """Read every file, in order; in worker processes when there are many (parsing is CPU-bound
    numpy and Python, and the compact columns are cheap to send back)."""
    workers = read_workers(len(files))
    if workers <= 1:
        yield from (_read_one(p) for p in files)
        return
    # fork is cheap and safe while this process runs a single thread; otherwise forkserver.
    method = "fork" if threading.active_count() == 1 else "forkserver"
    with multiprocessing.get_context(method).Pool(workers) as pool:
        yield from pool.imap(_read_one, files, chunksize=4)


def _json_object(path: Path) -> list[dict[str, Any]]:
    """[the JSON object in ``path``], or [] when it is missing or unreadable."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [obj] if isinstance(obj, dict) else []
