"""The ranks' status files, read one way for every live reader (the watcher, `top`, `attach`).

Each rank's trace writer thread rewrites ``status-rank{R}.json`` after every flush
(probes/liveness.py); its format and derived values are ``RankStatus`` (probes/status.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpdoctor import _env
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.rundir import RunDir

DEFAULT_FLOOR_S = 30.0  # the adaptive hang threshold never goes below this (DDPDOCTOR_HANG_FLOOR_S)
HANG_MULTIPLE = 5.0  # ... and is this many times the slowest step any rank has seen


def hang_floor_s() -> float:
    """The adaptive threshold's floor: DDPDOCTOR_HANG_FLOOR_S, else DEFAULT_FLOOR_S (a ValueError
    in one line when the variable is no positive number)."""
    return _env.number(_env.HANG_FLOOR, 0.0) or DEFAULT_FLOOR_S


def read_statuses(run_dir: Path) -> dict[int, RankStatus]:
    """The latest status of every rank (a file being replaced is simply read next time)."""
    out: dict[int, RankStatus] = {}
    for rank, path in RunDir(run_dir).statuses():
        status = RankStatus.read(path)
        if status is not None:
            out[rank] = status
    return out


def adaptive_threshold(statuses: Mapping[int, RankStatus], floor_s: float, multiple: float) -> float:
    """``multiple`` x the slowest step seen on any rank, never below ``floor_s``."""
    slowest = max((s.max_step_s for s in statuses.values()), default=0.0)
    return max(floor_s, multiple * slowest)


def snapshot(statuses: Mapping[int, RankStatus], but: int) -> dict[str, Any]:
    """What the other ranks were doing: phase, op, seq and step."""
    out = {}
    for rank, st in sorted(statuses.items()):
        if rank == but:
            continue
        phase = st.phase or {}
        out[str(rank)] = {
            "phase": phase.get("name"),
            "op": phase.get("op"),
            "seq": phase.get("seq"),
            "step": st.step,
        }
    return out
