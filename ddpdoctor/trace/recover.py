"""A rank trace whose header line was cut (a disk that filled at its first write, a file
damaged later) still holds every event the rank recorded after it. Reading it as "no trace"
would make a rank that trained for minutes one that never started, and the diagnosis would
blame it. The reader keeps such a trace under a stand-in header (``header_cut``); this module
fills that header in from what else the run directory knows:

* who: the rank's ``proc-rank{R}.json`` (pid, host, world size; ``probes/early.py``), the
  other ranks' headers for what all ranks share (world size, backend);
* when: the header anchored the rank's monotonic timestamps to wall time. Its own
  ``rank_error`` record carries both clocks (exact). Else its gradient all-reduces and
  collectives end together with the same sequence numbers on another rank (within the
  collective's own skew, a few ms), which places its clock on that rank's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import schema

CUT = "header_cut"  # the stand-in header's flag: how the rank's clock was placed, once restored
_SHARED = ("world_size", "backend", "torch", "argv", "frameworks", "schema")


def restore_headers(ranks: dict[int, Any], run_dirs: list[Path], notes: list[str]) -> None:
    """Fill in the stand-in header of every trace whose header was cut, saying so in ``notes``."""
    whole = [t for t in ranks.values() if not t.header.get(CUT)]
    for trace in ranks.values():
        if not trace.header.get(CUT):
            continue
        header = trace.header
        for key in _SHARED:
            found = next((t.header[key] for t in whole if key in t.header), None)
            if found is not None:
                header.setdefault(key, found)
        header.update(_proc(run_dirs, trace.rank, trace.path))
        wall_us, how = _anchor(trace, whole)
        header["wall_ns"], header["mono_ns"], header[CUT] = wall_us * 1000, 0, how
        notes.append(
            f"rank {trace.rank}'s trace header was cut ({trace.path.name}): its events are kept, {how}"
        )


def _proc(run_dirs: list[Path], rank: int, trace_path: Path) -> dict[str, Any]:
    """What the rank's proc file says of it (the one beside its trace)."""
    for run_dir in [trace_path.parent, *run_dirs]:
        path = RunDir(run_dir).procs().get(rank)
        if path is None:
            continue
        try:
            info = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(info, dict):
            return {k: info[k] for k in ("pid", "host", "world_size", "local_rank", "restart") if k in info}
    return {}


def _anchor(trace: Any, whole: list[Any]) -> tuple[int, str]:
    """(wall µs at the trace's time 0, how that was found)."""
    for ts, _step, info in trace.meta.get(schema.RANK_ERROR, []):
        if isinstance(info.get("wall_ns"), int):
            return info["wall_ns"] // 1000 - ts, "its clock placed by its exception record"
    own = trace.clock_offset_us() or 0
    for ref in whole:
        offsets = []
        for kind, seq_at in ((schema.ALLREDUCE, 2), (schema.COLLECTIVE, 4)):
            mine, theirs = _ends_by_seq(trace, kind, seq_at), _ends_by_seq(ref, kind, seq_at)
            offsets += [theirs[s] - mine[s] for s in mine.keys() & theirs.keys()]
        if offsets:
            # on rank ref's wall clock; this rank's own wall clock is that less its clock offset
            base = ref.wall_offset_us() + (ref.clock_offset_us() or 0) - own
            return base + int(
                np.median(offsets)
            ), f"its clock placed by rank {ref.rank}'s matching collectives"
    if whole:
        return whole[0].wall_offset_us(), f"its clock unknown: drawn from rank {whole[0].rank}'s start"
    return 0, "its clock unknown"


def _ends_by_seq(trace: Any, kind: str, seq_at: int) -> dict[int, int]:
    """The end (µs, the trace's clock) of each event of ``kind`` by its sequence number."""
    ev = trace.kind(kind)
    if not len(ev):
        return {}
    seqs, ends = ev.ints(seq_at), ev.end
    return {int(s): int(e) for s, e in zip(seqs.tolist(), ends.tolist(), strict=True) if s >= 0}
