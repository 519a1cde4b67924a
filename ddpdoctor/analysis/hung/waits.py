"""Waits on a busy rank, judged at the end: what a slow rank-only phase cost the others.

The live watcher keeps every wait on a busy rank (``watch.json`` ``waits``) and every hang it
reported (``hang-N/summary.json``). When the job then went on and completed, a hang verdict
was wrong about the end: it becomes what it was, the same efficiency finding as a noted wait,
with its cost measured from the waiting ranks' own trace records. The live verdict stays in
the run directory (``hang-N/``) and in the finding's details.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from ddpdoctor.analysis.findings import Finding, detector, rank_list
from ddpdoctor.analysis.hung.hang import hang_finding
from ddpdoctor.analysis.hung.proof import op_label
from ddpdoctor.trace import schema
from ddpdoctor.trace.livephase import SYNC_LIVE_PHASES, LivePhase
from ddpdoctor.trace.reader import Run

_FIXES = (
    (
        ("eval", "valid", "test"),
        "spread evaluation over every rank with a DistributedSampler (each rank evaluates its "
        "share, then all_reduce the metrics), or evaluate less often",
    ),
    (
        ("save", "checkpoint", "ckpt"),
        "save asynchronously (torch.distributed.checkpoint.async_save, or a background thread "
        "copying a CPU state dict), or checkpoint less often",
    ),
    (("log", "print", "report", "plot"), "log less often, or hand the logging to a background thread"),
)
GENERIC_FIX = (
    "move the rank-only work off the other ranks' path: share it across ranks, run it in a "
    "background thread, or do it less often"
)


def went_on(summary: dict[str, Any], run: Run) -> bool:
    """The job moved past the live hang verdict and completed: it was slow, not hung."""
    if any(w.get("killed_on_hang") for w in run.watches):
        return False
    if summary.get("recovered"):
        return True
    ranks = [int(r) for r in (summary.get("statuses") or {})]
    return (
        run.exit_code == 0
        and bool(ranks)
        and all(r in run.ranks and run.ranks[r].ended_cleanly for r in ranks)
    )


def fix_for(function: str) -> str:
    name = function.lower()
    return next((fix for words, fix in _FIXES if any(w in name for w in words)), GENERIC_FIX)


def _idle_s(run: Run, rank: int, phase: dict[str, Any]) -> float | None:
    """How long the rank really waited in that sync point, from its own trace (None: not found)."""
    return _wait_of(run, rank, phase)[0]


def _wait_of(run: Run, rank: int, phase: dict[str, Any]) -> tuple[float | None, int | None]:
    """(seconds the rank waited in that sync point, the step it was in), from its own trace."""
    trace = run.ranks.get(rank)
    seq = phase.get("seq")
    if trace is None or not isinstance(seq, int) or seq < 0:
        return None, None
    if phase.get("name") == LivePhase.COLLECTIVE:
        ev = trace.kind(schema.COLLECTIVE)
        hit = (ev.ints(4) == seq) & ev.equals(0, phase.get("op"))
    elif phase.get("name") == LivePhase.SYNC_BUFFERS:
        ev = trace.kind(schema.SYNC_BUFFERS)
        hit = ev.ints(0) == seq
    elif phase.get("name") == LivePhase.DDP_INIT:
        ev = trace.kind(schema.DDP_INIT)
        hit = np.array([isinstance(f[0], dict) and f[0].get("seq") == seq for f in ev.fields], dtype=bool)
    else:
        return None, None
    durations = ev.dur[hit]
    if not len(durations):
        return None, None
    i = int(durations.argmax())
    return float(durations[i]) / 1e6, int(ev.step[hit][i])


def _point(phase: dict[str, Any]) -> str:
    return f"{op_label(phase)} #{phase.get('seq')}"


def _episodes(run: Run) -> Iterable[dict[str, Any]]:
    """Every wait on a busy rank: noted live, or a hang verdict the job then outlived."""
    seen: set[tuple[Any, ...]] = set()
    # A wait that turned into a hang verdict on the same rank is the hang's start, not work:
    # a stuck rank looks busy until its CPU has been idle for a full measuring window.
    stuck = [
        (set((h.get("verdict") or {}).get("culprits") or []), float(h.get("detected_wall") or 0.0))
        for h in run.hangs
        if not went_on(h, run)
    ]
    for watch in run.watches:
        for ep in watch.get("waits") or []:
            busy = set(ep.get("busy") or [])
            if any(busy and busy <= c and float(ep.get("start_wall") or 0.0) <= t for c, t in stuck):
                continue
            # Every node of a multi-node job notes the job's wait (supervisor/board.py): once.
            points = sorted((r, _point(p)) for r, p in (ep.get("phases") or {}).items())
            key = (tuple(ep.get("waiting") or ()), tuple(ep.get("busy") or ()), tuple(points))
            if key not in seen:
                seen.add(key)
                yield {**ep, "live_verdict": None}
    for summary in run.hangs:
        if not went_on(summary, run):
            continue
        finding = hang_finding(summary)
        if finding is None:
            continue
        ranks = finding.details.get("ranks") or {}
        waiting = sorted(int(r) for r, s in ranks.items() if s.get("phase") in SYNC_LIVE_PHASES)
        busy = sorted(int(r) for r in ranks if int(r) not in waiting)
        statuses = summary.get("statuses") or {}
        where = {}
        for r in busy:
            frame = ranks[str(r)].get("user_frame") or {}
            if frame:
                base = os.path.basename(str(frame.get("file")))
                where[str(r)] = f"{frame.get('function')}() {base}:{frame.get('line')}"
        yield {
            "waiting": waiting,
            "busy": busy,
            "where": where,
            "phases": {str(r): (statuses.get(str(r)) or {}).get("phase") or {} for r in waiting},
            "wait_s": float(summary.get("quiet_s") or 0.0),
            "live_verdict": {"text": summary.get("text"), "hang_dir": summary.get("hang_dir")},
        }


@detector
def rank_only_work(run: Run) -> Iterable[Finding]:
    """One finding per busy rank and place: the others' idle time at the sync point after it."""
    groups: dict[tuple[tuple[int, ...], str], list[dict[str, Any]]] = {}
    for ep in _episodes(run):
        if not ep.get("waiting") or not ep.get("busy"):
            continue
        busy = tuple(ep["busy"])
        where = str((ep.get("where") or {}).get(str(busy[0])) or "user code")
        groups.setdefault((busy, where.rsplit(":", 1)[0]), []).append(ep)  # any line of one function
    for (busy, _), eps in sorted(groups.items()):
        where = str((eps[0].get("where") or {}).get(str(busy[0])) or "user code")
        waiting = sorted({r for ep in eps for r in ep["waiting"]})
        idle: dict[str, float] = {}
        points: list[str] = []
        steps: set[int | None] = set()
        for ep in eps:
            for r in ep["waiting"]:
                phase = (ep.get("phases") or {}).get(str(r)) or {}
                spent, step = _wait_of(run, r, phase)
                steps.add(step)
                spent = float(ep.get("wait_s") or 0.0) if spent is None else spent
                idle[str(r)] = round(idle.get(str(r), 0.0) + spent, 3)
                if phase and _point(phase) not in points:
                    points.append(_point(phase))
        worst = max(idle.values(), default=0.0)
        function = where.split("(")[0]
        at = ", ".join(points) if points else "the next sync point"
        summary = (
            f"rank(s) {rank_list(waiting)} idled {worst:.1f} s at {at} while rank(s) "
            f"{rank_list(busy)} ran {where}"
        )
        verdicts = [ep["live_verdict"] for ep in eps if ep.get("live_verdict")]
        if verdicts:
            summary += " (reported live as a hang; the job then completed)"
        setup = len(eps) == 1 and steps == {-1}  # once, before the first training step
        if setup:
            summary = f"one-time setup before step 0: {summary}; it cost {worst:.1f} s once, not per step"
        yield Finding(
            "rank_only_work",
            "info" if setup else "warning",
            sorted(busy),
            summary,
            fix=f"{fix_for(function)[0].upper()}{fix_for(function)[1:]}.",
            details={
                "waiting": waiting,
                "busy": list(busy),
                "where": where,
                "sync_points": points,
                "idle_s": idle,
                "episodes": len(eps),
                "live_verdicts": verdicts,
            },
        )
