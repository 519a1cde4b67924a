"""Tolerant reader of run directories: rank traces plus the supervisor's ``run.json``.

A line that is truncated (a rank killed mid-write) or corrupt is skipped and counted, never
fatal. Nothing read from a trace is ever executed or unpickled: it is JSON, and only JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddpdoctor.trace import schema

RUN_META = "run.json"
_TRACE_NAME = re.compile(r"^trace-rank(\d+)(?:-attempt(\d+))?\.jsonl$")


class TraceError(Exception):
    """A run directory that cannot be read at all (missing, or holding no trace)."""


@dataclass
class Events:
    """One kind of event on one rank, in columns: µs since the rank's clock anchor."""

    ts: np.ndarray
    dur: np.ndarray
    step: np.ndarray
    fields: list[tuple]

    def __len__(self) -> int:
        return len(self.ts)

    @property
    def end(self) -> np.ndarray:
        return self.ts + self.dur

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
        fwd = self.kind(schema.FORWARD)
        return sum(1 for f in fwd.fields if f and f[0] == 1)

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
    """Parse one rank's trace file; raises TraceError only when it has no readable header."""
    header: dict[str, Any] | None = None
    skipped = 0
    columns: dict[str, tuple[list[int], list[int], list[int], list[tuple]]] = {}
    meta: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for rec in _records(path):
        if not isinstance(rec, list) or not rec or not isinstance(rec[0], str):
            skipped += 1
            continue
        kind = rec[0]
        if kind == schema.HEADER:
            if header is None and len(rec) > 1 and isinstance(rec[1], dict):
                header = rec[1]
            continue
        if len(rec) < 4 or not all(isinstance(v, int) for v in rec[1:4]):
            skipped += 1
            continue
        if len(rec) == 5 and isinstance(rec[4], dict) and kind not in _EVENT_KINDS:
            meta.setdefault(kind, []).append((rec[1], rec[3], rec[4]))
            continue
        cols = columns.get(kind)
        if cols is None:
            cols = columns[kind] = ([], [], [], [])
        cols[0].append(rec[1])
        cols[1].append(rec[2])
        cols[2].append(rec[3])
        cols[3].append(tuple(rec[4:]))
    if header is None or "rank" not in header:
        raise TraceError(f"{path}: no trace header")
    events = {
        kind: Events(
            np.asarray(ts, dtype=np.int64),
            np.asarray(dur, dtype=np.int64),
            np.asarray(step, dtype=np.int64),
            fields,
        )
        for kind, (ts, dur, step, fields) in columns.items()
    }
    return RankTrace(int(header["rank"]), header, path, events, meta, skipped)


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
        for rank, path in sorted(_trace_files(run_dir).items()):
            try:
                trace = read_trace(path)
            except TraceError as exc:
                notes.append(str(exc))
                continue
            except OSError as exc:
                notes.append(f"{path}: {exc.strerror}")
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


def _json_object(path: Path) -> list[dict[str, Any]]:
    """[the JSON object in ``path``], or [] when it is missing or unreadable."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [obj] if isinstance(obj, dict) else []
