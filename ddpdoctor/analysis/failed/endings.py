"""How each rank's record ended, decided in one place from every fact there is: its trace
(a clean close, an uncaught exception), the supervisor's records of its process (ends.json,
the watcher's exit records) and whether ddpdoctor stopped the job on a hang. The ledger, the
failure view and the failure findings all read a rank's ending from here.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpdoctor.analysis.findings import clip
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import RankTrace, Run

# Errors a rank raises because a peer died or stalled: consequences, not the root cause.
_CONSEQUENCE_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
_CONSEQUENCE_TEXT = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "socket",
    "nccl communicator was aborted",
)


@dataclass(frozen=True)
class Ending:
    """How a rank's record ended. ``how``: clean_exit, exit_code (Python's own exit with a
    non-zero status: sys.exit(3), SystemExit), exception, signal, vanished (no clean close, no
    exception, no signal seen), stopped_on_hang (ddpdoctor stopped the hung job),
    interrupted (the user's Ctrl-C of a hung job, on which ddpdoctor ended its ranks),
    running (the trace just stops: read while the job runs) or never_started (no trace)."""

    how: str
    step: int = -1
    signal: str | None = None
    error: dict[str, Any] | None = None
    consequence: bool = False  # the error says a peer went away: not this rank's own fault
    wall_s: float | None = None
    code: int | None = None  # the status it exited with, where known

    def describe(self) -> str:
        after = f" after step {self.step}" if self.step >= 0 else " before its first step"
        if self.how == "exception" and self.error:
            message = str(self.error.get("message") or "").splitlines()[:1]
            return f"raised {self.error.get('type')}{': ' + clip(message[0], 160) if message else ''}{after}"
        if self.how == "signal":
            return f"was killed by {self.signal}{after}"
        return {
            "clean_exit": f"exited cleanly{after}",
            "exit_code": f"exited with code {self.code}, no traceback (sys.exit or SystemExit){after}",
            "vanished": f"stopped without a clean exit, an exception or a signal seen{after}",
            "stopped_on_hang": f"was stopped by ddpdoctor while hung{after}",
            "interrupted": f"was stopped on the user's interrupt (Ctrl-C) while hung{after}",
            "never_started": "never called init_process_group (no trace)",
        }.get(self.how, f"was still running{after}")


def is_consequence(error: dict[str, Any]) -> bool:
    """True for an error that says a peer went away, rather than one of this rank's own."""
    kind, message = str(error.get("type", "")), str(error.get("message", "")).lower()
    return kind in _CONSEQUENCE_TYPES or any(t in message for t in _CONSEQUENCE_TEXT)


def signal_name(sig: Any) -> str | None:
    if not sig:
        return None
    try:
        return signal.Signals(int(sig)).name
    except (ValueError, TypeError):
        return f"signal {sig}"


def merged_watch(run: Run) -> dict[str, Any]:
    merged: dict[str, Any] = {"rank_exits": {}, "rank_errors": {}, "killed_on_hang": False}
    for w in run.watches:
        for key in ("rank_exits", "rank_errors"):
            merged[key].update(w.get(key) or {})
        merged["killed_on_hang"] = merged["killed_on_hang"] or bool(w.get("killed_on_hang"))
    return merged


def how_it_ended(run: Run, rank: int, watch: dict[str, Any] | None = None) -> Ending:
    """The one place that decides how a rank's record ended, from every fact there is: its own
    trace (clean close, uncaught exception), the supervisor's exit record (signal, step) and
    whether ddpdoctor stopped the job on a hang."""
    watch = watch if watch is not None else merged_watch(run)
    trace = run.ranks.get(rank)
    exit_info = (watch.get("rank_exits") or {}).get(str(rank)) or {}
    if trace is None:  # what the supervisor saw of its process, if it started (probes/early.py)
        end = run.ends.get(rank) or {}
        sig = end.get("signal") if end.get("how") == "signal" else None
        return Ending(
            "never_started",
            signal=str(sig) if sig else signal_name(exit_info.get("signal")),
            consequence=bool(end.get("consequence")),
            wall_s=end.get("at_wall"),
        )
    step = last_step_started(trace)
    if isinstance(exit_info.get("step"), int):
        step = max(step, exit_info["step"])
    errors = [
        info for _, _, info in trace.meta.get(schema.RANK_ERROR, []) if info.get("thread") == "MainThread"
    ]
    if errors:
        err = errors[0]
        wall = err.get("wall_ns")
        return Ending(
            "exception", step, error=err, consequence=is_consequence(err), wall_s=wall / 1e9 if wall else None
        )
    when = exit_info.get("last_heartbeat_wall") or exit_info.get("seen_wall")
    facts = _Facts(run.ends.get(rank) or {}, exit_info, trace, bool(watch.get("killed_on_hang")), when)
    row = next(r for r in _ENDINGS if r.applies(facts))
    code = facts.end.get("code")
    return Ending(row.how, step, signal=row.signal(facts), wall_s=row.wall(facts), code=code)


@dataclass(frozen=True)
class _Facts:
    """What is known of a rank that left a trace and raised nothing, for the rows below."""

    end: dict[str, Any]  # the supervisor's word after the job (supervisor/ends.py)
    exit_info: dict[str, Any]  # the watcher's glimpse of its process leaving
    trace: RankTrace
    killed_on_hang: bool  # ddpdoctor stopped the job on a hang
    when: float | None  # its last heartbeat, or when the watcher saw it gone

    @property
    def own_wall(self) -> float | None:
        return self.end.get("at_wall") or self.when


@dataclass(frozen=True)
class _EndingRow:
    how: str
    applies: Callable[[_Facts], bool]
    signal: Callable[[_Facts], str | None] = lambda f: None
    wall: Callable[[_Facts], float | None] = lambda f: f.when


# How a rank that raised nothing ended: the first row that applies. The rank's own record
# (ends.json) comes before its trace's clean close, which comes before the watcher's glimpse.
_ENDINGS = (
    # the user's Ctrl-C of a hung job: ddpdoctor ended it
    _EndingRow("interrupted", lambda f: bool(f.end.get("interrupted")), lambda f: str(f.end.get("signal")),
               lambda f: f.own_wall),
    _EndingRow("signal", lambda f: f.end.get("how") == "signal" and bool(f.end.get("signal")),
               lambda f: str(f.end["signal"]), lambda f: f.own_wall),
    _EndingRow("vanished", lambda f: f.end.get("how") == "os_exit" and bool(f.end.get("code")),
               wall=lambda f: f.own_wall),
    _EndingRow("exit_code", lambda f: f.end.get("how") == "exit" and bool(f.end.get("code")),
               wall=lambda f: f.own_wall),
    _EndingRow("clean_exit", lambda f: f.trace.ended_cleanly, wall=lambda f: _end_wall(f.trace)),
    _EndingRow("stopped_on_hang", lambda f: f.killed_on_hang),
    _EndingRow("signal", lambda f: bool(signal_name(f.exit_info.get("signal"))),
               lambda f: signal_name(f.exit_info.get("signal"))),
    _EndingRow("vanished", lambda f: bool(f.exit_info)),
    _EndingRow("running", lambda f: True, wall=lambda f: None),  # the trace just stops
)  # fmt: skip


def last_step_started(trace: RankTrace) -> int:
    """The last training step the rank began: its last forward's step, one that raised included
    (it began its step, though it is no completed span), -1 before the first."""
    step = int(trace.kind(schema.FORWARD).step.max(initial=-1))
    for _, at, info in trace.meta.get(schema.RAISED, []):
        if info.get("kind") == schema.FORWARD and (info.get("fields") or [0])[0] == 1:
            step = max(step, at)
    return step


def _end_wall(trace: RankTrace) -> float | None:
    ends = trace.meta.get(schema.END, [])
    if not ends:
        return None
    return (int(trace.header.get("wall_ns", 0)) + ends[0][0] * 1000) / 1e9
