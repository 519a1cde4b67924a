"""Tolerant reader of run directories: rank traces, the supervisor's files, GPU samples.

A line that is truncated (a rank killed mid-write) or corrupt is skipped and counted, never
fatal. Nothing read from a trace is ever executed or unpickled: it is numbers and JSON.
Rank traces are binary (``binfmt.py``): each kind's records are read with one
``np.frombuffer`` into columns (``columns.py``); traces of earlier versions (JSON lines) are
read line by line with ``json``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import binfmt, recover, schema
from ddpdoctor.trace.columns import Events, Fields, Packed, Strings, distinct

_I64 = 2**63


class TraceError(Exception):
    """A run directory that cannot be read at all (missing, or holding no trace)."""


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
        """Training steps: the steps DDP forwards in grad mode ran in (the micro-batches of
        gradient accumulation under no_sync() share their optimizer step's number)."""
        fwd = self.kind(schema.FORWARD)
        return len(distinct(fwd.step[fwd.ints(0) == 1])) if len(fwd) else 0

    def wall_offset_us(self) -> int:
        """Add to this rank's timestamps to get its own wall-clock µs since the epoch."""
        return int(self.header["wall_ns"]) // 1000

    def clock_offset_us(self) -> int | None:
        """Add to this rank's wall clock to get rank 0's (its ``clock`` record), None if unmeasured."""
        for _ts, _step, info in self.meta.get(schema.CLOCK, []):
            if isinstance(info.get("offset_ns"), int):
                return int(info["offset_ns"]) // 1000
        return None


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
    ends: dict[int, dict[str, Any]] = field(default_factory=dict)  # ends.json: how each rank ended
    # Views computed once from the run and shared by the analyses and the reports (the GPU view).
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def once(self, key: str, compute: Callable[[Run], Any]) -> Any:
        """``compute(self)``, computed once per run: the views several analyses and the reports
        share (the ledgers, the straggler table) are built once, not once per reader."""
        if key not in self.derived:
            self.derived[key] = compute(self)
        return self.derived[key]

    @property
    def world_size(self) -> int:
        sizes = [int(t.header.get("world_size", 0)) for t in self.ranks.values()]
        # ranks that never wrote a trace are known from the supervisor's ends.json
        sizes += [int(e["world_size"]) for e in self.ends.values() if isinstance(e.get("world_size"), int)]
        return max(sizes + [len(self.ranks), max(self.ends, default=-1) + 1])

    @property
    def elsewhere(self) -> dict[int, str]:
        """Ranks of the job whose node's run dir is not among those read, with where they ran:
        no trace and no record of their process here, and the job spans nodes (the watchers'
        shared node map in run.json, else the launcher's --nnodes)."""
        jobs = [m.get("job") or {} for m in self.metas]
        here = {int(job["node"]) for job in jobs if isinstance(job.get("node"), int)}
        where: dict[int, str] = {}
        multi = False
        for job in jobs:
            multi = multi or int(job.get("nnodes") or 1) > 1
            for node, info in (job.get("nodes") or {}).items():
                if str(node).isdigit() and int(node) not in here:
                    for r in info.get("ranks") or []:
                        where[int(r)] = f"node {node} ({info.get('host')}, run dir {info.get('run_dir')})"
        if not multi and not where:
            return {}
        absent = set(range(self.world_size)) - set(self.ranks) - set(self.ends)
        return {r: where.get(r, "another node") for r in sorted(absent)}

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


def read_meta(run_dir: Path) -> dict[str, Any]:
    """The supervisor's run.json, or {} when the job was instrumented without `ddpdoctor run`."""
    try:
        meta = json.loads((run_dir / RunDir.RUN_META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def load_run(dirs: Iterable[str | Path]) -> Run:
    """Read one or more run directories into one Run; raises TraceError if none holds a trace
    nor the supervisor's record of how its ranks ended (ends.json)."""
    paths = [Path(d) for d in dirs]
    ranks: dict[int, RankTrace] = {}
    metas: list[dict[str, Any]] = []
    notes: list[str] = []
    for run_dir in paths:
        if not run_dir.is_dir():
            raise TraceError(f"{run_dir}: not a directory")
        metas.append(read_meta(run_dir))
    files = [(rank, path) for run_dir in paths for rank, path in RunDir(run_dir).traces().items()]
    for (rank, path), trace in zip(files, _read_all(files), strict=True):
        if isinstance(trace, str):
            notes.append(trace)
            continue
        if rank in ranks:
            notes.append(f"rank {rank} appears in {ranks[rank].path} and {path}; using the latter")
        ranks[rank] = trace
    recover.restore_headers(ranks, paths, notes)
    skipped = sum(t.skipped_lines for t in ranks.values())
    if skipped:
        notes.append(f"skipped {skipped} truncated or corrupt trace line(s)")
    hangs: list[dict[str, Any]] = []
    watches: list[dict[str, Any]] = []
    for run_dir in paths:
        for path in RunDir(run_dir).hang_summaries():
            hangs.extend(_json_object(path))
        watches.extend(_json_object(run_dir / RunDir.WATCH))
    hangs = _one_per_job_verdict(hangs)
    ends: dict[int, dict[str, Any]] = {}
    for found in (_json_object(run_dir / RunDir.ENDS) for run_dir in paths):
        for rank, end in (found[0].get("ranks") or {} if found else {}).items():
            if str(rank).isdigit() and isinstance(end, dict):
                ends[int(rank)] = end
    if not ranks and not ends:
        where = ", ".join(str(p) for p in paths)
        raise TraceError(f"no rank traces in {where}" + (f" ({'; '.join(notes)})" if notes else ""))
    if not ranks:  # every rank failed before init_process_group: the supervisor's records say how
        notes.append("no rank wrote a trace: what is known comes from the supervisor (ends.json)")
    run = Run(paths, metas, ranks, notes, hangs, watches, _gpu_traces(paths, notes))
    run.ends = ends
    return run


def _one_per_job_verdict(hangs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every node writes the job's hang n (supervisor/board.py): one summary of it, with every
    node's stacks and the earliest kill. Summaries of one node's own verdict stay apart."""
    out: list[dict[str, Any]] = []
    shared: dict[int, dict[str, Any]] = {}
    for h in hangs:
        if len(h.get("nodes") or {}) < 2 or not isinstance(h.get("n"), int):
            out.append(h)
            continue
        first = shared.get(h["n"])
        if first is None:
            shared[h["n"]] = first = dict(h)
            out.append(first)
            continue
        first["stacks"] = {**(h.get("stacks") or {}), **(first.get("stacks") or {})}
        first["statuses"] = {**(h.get("statuses") or {}), **(first.get("statuses") or {})}
        kills = [k for k in (first.get("killed_wall"), h.get("killed_wall")) if k is not None]
        if kills:
            first["killed_wall"] = min(kills)
        first["recovered"] = bool(first.get("recovered")) and bool(h.get("recovered"))
    return out


def _gpu_traces(paths: list[Path], notes: list[str]) -> list[GpuTrace]:
    """Every node's GPU samples; an unreadable file is a note, never an error."""
    out: list[GpuTrace] = []
    for run_dir in paths:
        for path in RunDir(run_dir).gpu_files():
            try:
                out.append(read_gpu(path))
            except (TraceError, OSError) as exc:
                notes.append(str(exc))
    return out


def _read_one(file: tuple[int, Path]) -> RankTrace | str:
    """A rank's trace, or why it cannot be read (a note)."""
    rank, path = file
    try:
        return read_trace(path, rank)
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


def _read_all(files: list[tuple[int, Path]]) -> Iterator[RankTrace | str]:
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
