"""Tolerant reader of run directories: every rank's trace, the supervisor's files, GPU samples.

Rank files are read by ``rankfile.py`` (in worker processes for a large run); an unreadable
one is a note, never fatal. Nothing read from a trace is ever executed or unpickled.
"""

from __future__ import annotations

import collections
import functools
import gc
import json
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.pool import AsyncResult
from pathlib import Path
from typing import Any

from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import handoff, recover
from ddpdoctor.trace.rankfile import (
    RANK_VIEWS,
    GpuTrace,
    RankTrace,
    RankView,
    TraceError,
    read_gpu,
    read_trace,
    view_key,
)

__all__ = ["GpuTrace", "RankTrace", "Run", "TraceError", "load_run", "read_gpu", "read_meta", "read_trace"]


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
    profiles: list[dict[str, Any]] = field(default_factory=list)  # profile.json: a straggler's lines
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
    def stopped_lingering(self) -> bool:
        """A node's launcher, left in torchrun's exit barrier after its ranks exited cleanly,
        was stopped on the user's Ctrl-C (supervisor/lingering.py)."""
        return any(m.get(RunDir.STOPPED_LINGERING) for m in self.metas)

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
    run.profiles = [p for run_dir in paths for p in _json_object(run_dir / RunDir.PROFILE)]
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


def _read_one(file: tuple[int, Path], views: tuple[RankView, ...] = ()) -> RankTrace | str:
    """A rank's trace with its ``views`` computed, or why it cannot be read (a note)."""
    rank, path = file
    try:
        trace = read_trace(path, rank)
    except TraceError as exc:
        return str(exc)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    for func in views:
        try:
            trace.view(func)
        except Exception:  # noqa: BLE001 - left to the analysis, which fails on it as it would have
            trace.views.pop(view_key(func), None)
    return trace


def _read_into_slot(file: tuple[int, Path], slot: int) -> handoff.Parcel | RankTrace | str:
    """``_read_one`` in a forked worker, with every registered view, its trace's arrays handed
    over in shared slot ``slot`` (``handoff``)."""
    trace = _read_one(file, tuple(RANK_VIEWS))
    assert _SLOTS is not None  # set before the pool forked this worker
    return trace if isinstance(trace, str) else _SLOTS.pack(trace, slot)


_SLOTS: handoff.Slots | None = None  # the forked pool's shared slots, while it reads


def read_workers(files: int) -> int:
    """Processes to read rank files with: the usable cores (``DDPDOCTOR_READ_WORKERS``
    overrides), and 1 for small runs, where starting workers costs more than it saves."""
    env = os.environ.get("DDPDOCTOR_READ_WORKERS", "")
    cores = int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))
    return max(1, min(cores, files // PARALLEL_MIN_FILES))


PARALLEL_MIN_FILES = 16


def _read_all(files: list[tuple[int, Path]]) -> Iterator[RankTrace | str]:
    """Read every file, in order; in worker processes when there are many (parsing is CPU-bound
    numpy and Python, and the compact columns are cheap to send back), which also compute the
    registered rank views (``rankfile.rank_view``)."""
    workers = read_workers(len(files))
    if workers <= 1:
        yield from (_read_one(p) for p in files)
        return
    # fork is cheap and safe while this process runs a single thread; otherwise forkserver.
    # The registered rank views go by name: a forkserver's worker imports their modules.
    if threading.active_count() > 1:
        read = functools.partial(_read_one, views=tuple(RANK_VIEWS))
        with multiprocessing.get_context("forkserver").Pool(workers) as pool:
            yield from pool.imap(read, files, chunksize=4)
        return
    yield from _read_forked(files, workers)


def _read_forked(files: list[tuple[int, Path]], workers: int) -> Iterator[RankTrace | str]:
    """Read every file in forked workers, which hand the traces over in shared slots: a few
    files in flight per worker, each slot given to the next file once its trace is copied out."""
    global _SLOTS
    slots = _SLOTS = handoff.Slots(workers * handoff.SLOTS_PER_WORKER)
    # The collector's first threshold raised while reading, in this process and the workers
    # (they inherit it), as the commands read (analysis.diagnosis.fewer_collections): at the
    # default thresholds the workers spent 3 s more of system time at 1,024 ranks (cause not
    # found; the pipe's workers did not).
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], READ_GC_THRESHOLD), *thresholds[1:])
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            _SLOTS = None  # the workers have their copy
            todo = iter(files)
            flight: collections.deque[tuple[AsyncResult, int]] = collections.deque()
            for slot, file in zip(range(slots.count), todo, strict=False):
                flight.append((pool.apply_async(_read_into_slot, (file, slot)), slot))
            while flight:
                result, slot = flight.popleft()
                got = result.get()
                got = slots.unpack(got) if isinstance(got, handoff.Parcel) else got
                file = next(todo, None)
                if file is not None:  # the slot is free again
                    flight.append((pool.apply_async(_read_into_slot, (file, slot)), slot))
                yield got
    finally:
        gc.set_threshold(*thresholds)
        _SLOTS = None
        slots.close()


READ_GC_THRESHOLD = 50_000  # analysis.diagnosis.GC_THRESHOLD


def _json_object(path: Path) -> list[dict[str, Any]]:
    """[the JSON object in ``path``], or [] when it is missing or unreadable."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [obj] if isinstance(obj, dict) else []
