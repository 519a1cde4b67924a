"""``hang-N/``: what a hang leaves in the run dir, written by either of the two places that
judge one: the watcher's live verdict (watch.py) and ``ddpdoctor attach`` (live/attach_run.py).
One format, so `diagnose` and `report` (trace/reader.py) give the same hang finding for both.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from ddpdoctor.probes.status import RankStatus
from ddpdoctor.rundir import RunDir, write_atomic
from ddpdoctor.supervisor.stacks import render_stack

HANG_SCHEMA = "ddpdoctor.hang/1"


def summary(
    hang_dir: Path,
    n: int,
    statuses: dict[int, RankStatus],
    stacks: dict[int, Any],
    text: str,
    **fields: Any,
) -> dict[str, Any]:
    """``hang-N/summary.json``: the ranks' statuses and stacks at the verdict, the report's text,
    and ``fields`` (detected_wall, threshold_s, quiet_s, world_size, action, reported_wall; the
    watcher adds its node, the nodes it judged and its verdict)."""
    return {
        "schema": HANG_SCHEMA,
        "n": n,
        "hang_dir": str(hang_dir),
        **fields,
        "statuses": {str(r): s.to_json() for r, s in statuses.items()},
        "stacks": {str(r): s for r, s in stacks.items()},
        "text": text,
        "recovered": False,
    }


def save(hang: dict[str, Any]) -> None:
    """Write a summary to its ``hang-N/summary.json`` (raises OSError; callers decide)."""
    write_atomic(Path(hang["hang_dir"]) / RunDir.HANG_SUMMARY, json.dumps(hang, indent=1, default=str))


def save_stacks(run_dir: Path, n: int, stacks: dict[int, dict[str, Any]]) -> None:
    """``hang-N/stack-rank{R}.txt``: each rank's stack dump as text (never raises)."""
    for rank, dump in stacks.items():
        raw = dump.get("text") or json.dumps(dump.get("threads", []), indent=1)
        with contextlib.suppress(OSError):
            RunDir(run_dir).hang_stack(n, rank).write_text(render_stack(rank, dump, raw))
