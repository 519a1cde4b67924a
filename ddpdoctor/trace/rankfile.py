"""One rank's trace file (and one node's GPU samples), read tolerantly.

A record that is truncated (a rank killed mid-write) or corrupt is skipped and counted, never
fatal. Nothing read from a trace is ever executed or unpickled: it is numbers and JSON.
Rank traces are binary (``binfmt.py``): each kind's records are read with one
``np.frombuffer`` into columns (``columns.py``); traces of earlier versions (JSON lines) are
read line by line with ``json``. ``reader.py`` reads whole run directories into a ``Run``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddpdoctor.trace import binfmt, recover, schema
from ddpdoctor.trace.columns import Events, Fields, Packed, Strings, count_distinct, distinct

_I64 = 2**63


class TraceError(Exception):
    """A run directory that cannot be read at all (missing, or holding no trace)."""


RankView = Callable[["RankTrace"], Any]
RANK_VIEWS: list[RankView] = []


def rank_view(func: RankView) -> RankView:
    """Register a view of one rank's trace alone (its phase statistics, its step times): the
    reader computes every registered view in its worker processes, next to the decoding and in
    parallel, so the analysis does not walk each rank's events again in the parent; where a
    trace is read in the parent (small runs) a view is computed on first use."""
    RANK_VIEWS.append(func)
    return func


def view_key(func: RankView) -> str:
    """A view's name: the same in a worker process and in the parent."""
    return f"{func.__module__}.{func.__qualname__}"


@dataclass
class RankTrace:
    """Everything one rank recorded."""

    rank: int
    header: dict[str, Any]
    path: Path
    events: dict[str, Events]
    meta: dict[str, list[tuple[int, int, dict[str, Any]]]]  # kind -> [(ts, step, info)]
    skipped_lines: int = 0
    # rank_view's, of these events: not init, so that a copy with other events (dataclasses.
    # replace: the device-timed view) starts without them.
    views: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def view(self, func: RankView) -> Any:
        """``func(self)``, computed once per trace (in the reader's worker, if it was registered
        with ``rank_view`` before the run was read). Shared: never modify what it returns."""
        key = view_key(func)
        if key not in self.views:
            self.views[key] = func(self)
        return self.views[key]

    @property
    def host(self) -> str:
        return str(self.header.get("host", "?"))

    @property
    def ended_cleanly(self) -> bool:
        return bool(self.meta.get(schema.END))

    @property
    def last_ts(self) -> int:
        """The latest timestamp this rank wrote (µs), or 0."""
        return int(self.view(_last_ts))

    def kind(self, kind: str) -> Events:
        return self.events.get(kind) or Events.empty()

    @property
    def steps(self) -> int:
        """Training steps: the steps DDP forwards in grad mode ran in (the micro-batches of
        gradient accumulation under no_sync() share their optimizer step's number)."""
        fwd = self.kind(schema.FORWARD)
        return count_distinct(fwd.step[fwd.ints(0) == 1]) if len(fwd) else 0

    def wall_offset_us(self) -> int:
        """Add to this rank's timestamps to get its own wall-clock µs since the epoch."""
        return int(self.header["wall_ns"]) // 1000

    def clock_offset_us(self) -> int | None:
        """Add to this rank's wall clock to get rank 0's (its ``clock`` record), None if unmeasured."""
        for _ts, _step, info in self.meta.get(schema.CLOCK, []):
            if isinstance(info.get("offset_ns"), int):
                return int(info["offset_ns"]) // 1000
        return None


@rank_view
def _last_ts(trace: RankTrace) -> int:
    """``RankTrace.last_ts``, computed where the trace is read (every event's end)."""
    ends = [int(ev.end.max()) for ev in trace.events.values() if len(ev)]
    ends += [records[-1][0] for records in trace.meta.values() if records]
    return max(ends, default=0)


def read_trace(path: Path, rank: int | None = None) -> RankTrace:
    """Read one rank's trace: binary (``binfmt.py``), or the JSON lines of traces recorded
    before version 3. Raises TraceError when it has no readable header and no events, or no
    header and no ``rank`` (from its file name) to stand in for it, or was written by a later
    ddpdoctor (saying which version it needs). A trace whose header was cut keeps its events
    under a stand-in header, filled in by ``recover.restore_headers``."""
    data = Path(path).read_bytes()
    if binfmt.is_binary(data) or Path(path).suffix == ".bin":  # .bin: its header may be cut
        return _read_binary(Path(path), data, rank)
    return _read_jsonl(Path(path), _records(path, data), rank)


def _stand_in(path: Path, header: dict[str, Any] | None, rank: int | None, found: bool) -> dict[str, Any]:
    """The trace's header, or a stand-in for a cut one (its events then keep the rank's own
    clock: ``recover.restore_headers`` places it)."""
    if header is not None and "rank" in header:
        _check_version(path, header)
        return header
    if rank is None or not found:
        raise TraceError(f"{path}: no trace header")
    return {"rank": rank, recover.CUT: True}


def _read_binary(path: Path, data: bytes, rank: int | None) -> RankTrace:
    dec = binfmt.decode(data)
    header = _stand_in(path, dec.header, rank, bool(dec.records or dec.meta))
    anchor = dec.anchor
    events: dict[str, Events] = {}
    for kind, rec in dec.records.items():
        t0, t1 = rec["t0"], rec["t1"]
        cols: list[Packed | Strings] = []
        for i, code in enumerate(dec.specs[kind]):
            col = rec[f"f{i}"]
            if code in schema.INTERNED:
                ids, codes = distinct(col, inverse=True)
                table = [binfmt.value(dec.strings, int(j)) for j in ids.tolist()]
                cols.append(Strings(codes.astype(np.min_scalar_type(max(len(ids) - 1, 0))), table))
            else:
                cols.append(Packed.of(col))
        events[kind] = Events(
            Packed.of((t0 - anchor) // 1000),
            Packed.of((t1 - t0) // 1000),
            Packed.of(rec["step"]),
            Fields(cols, len(rec)),
        )
    meta: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for kind, ts, _, step, info in dec.meta:
        if isinstance(kind, str) and isinstance(ts, int) and isinstance(step, int):
            meta.setdefault(kind, []).append(((ts - anchor) // 1000, step, info))
    for records in meta.values():
        records.sort(key=lambda r: r[0])
    return RankTrace(int(header["rank"]), header, path, events, meta, dec.skipped + (dec.end < len(data)))


def _check_version(path: Path, header: dict[str, Any]) -> None:
    version = str(header.get("schema", ""))
    if version.startswith("ddpdoctor.trace/") and version not in schema.SCHEMAS:
        raise TraceError(
            f"{path}: recorded in trace format {version}; this ddpdoctor reads "
            f"{', '.join(schema.SCHEMAS)}: upgrade ddpdoctor to read it"
        )


def _read_jsonl(path: Path, recs: list[Any], rank: int | None) -> RankTrace:
    """A JSON-lines trace (versions 1 and 2, or an export): every line through ``json``."""
    header: dict[str, Any] | None = None
    skipped = 0
    columns: dict[str, tuple[list[int], list[int], list[int], list[tuple]]] = {}
    meta: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for rec in recs:
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
        if len(rec) == 5 and isinstance(rec[4], dict) and kind not in schema.KINDS:
            meta.setdefault(kind, []).append((rec[1], rec[3], rec[4]))
            continue
        cols = columns.get(kind)
        if cols is None:
            cols = columns[kind] = ([], [], [], [])
        for col, value in zip(cols, (rec[1], rec[2], rec[3], tuple(rec[4:])), strict=True):
            col.append(value)
    header = _stand_in(path, header, rank, bool(columns or meta))
    events = {
        kind: Events(*(Packed.of(np.asarray(c, dtype=np.int64)) for c in cols[:3]), cols[3])
        for kind, cols in sorted(columns.items())
    }
    return RankTrace(int(header["rank"]), header, path, events, meta, skipped)


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


def _records(path: Path, data: bytes | None = None) -> list[Any]:
    """Every line's JSON value, None for a corrupt one. The whole file parses as one array in a
    single call when it is intact (ten times faster than line by line: large runs), and line by
    line only when that fails."""
    data = Path(path).read_bytes() if data is None else data
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
