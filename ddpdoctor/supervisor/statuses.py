"""The ranks' status files, read one way for every live reader (the watcher, `top`, `attach`).

Each rank's trace writer thread rewrites ``status-rank{R}.json`` after every flush
(probes/liveness.py); a file being replaced is simply read next time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddpdoctor.rundir import RunDir
from ddpdoctor.trace.schema import SYNC_LIVE_PHASES


def read_statuses(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The latest status of every rank (a file being replaced is simply read next time)."""
    out: dict[int, dict[str, Any]] = {}
    for rank, path in RunDir(run_dir).statuses():
        try:
            with open(path, "rb") as fh:
                status = json.loads(fh.read())
        except (OSError, ValueError):
            continue
        if isinstance(status, dict):
            out[rank] = status
    return out


def adaptive_threshold(statuses: dict[int, dict[str, Any]], floor_s: float, multiple: float) -> float:
    """``multiple`` x the slowest step seen on any rank, never below ``floor_s``."""
    slowest = max((float(s.get("max_step_s") or 0.0) for s in statuses.values()), default=0.0)
    return max(floor_s, multiple * slowest)


def sync_wait_s(status: dict[str, Any], now: float) -> float:
    """How long the rank has been inside its current sync point (0 if it is in none)."""
    phase = status.get("phase")
    if not phase or phase.get("name") not in SYNC_LIVE_PHASES:
        return 0.0
    return float(phase.get("since_s", 0.0)) + max(0.0, now - float(status.get("heartbeat_wall") or now))


def waits_now(status: dict[str, Any], now: float, at_least_s: float = 1.0) -> bool:
    """In a sync point for ``at_least_s`` or more: someone the job is waiting with."""
    phase = status.get("phase") or {}
    return phase.get("name") in SYNC_LIVE_PHASES and sync_wait_s(status, now) >= at_least_s


def snapshot(statuses: dict[int, dict[str, Any]], but: int) -> dict[str, Any]:
    """What the other ranks were doing: phase, op, seq and step."""
    out = {}
    for rank, st in sorted(statuses.items()):
        if rank == but:
            continue
        phase = st.get("phase") or {}
        out[str(rank)] = {
            "phase": phase.get("name"),
            "op": phase.get("op"),
            "seq": phase.get("seq"),
            "step": st.get("step"),
        }
    return out
