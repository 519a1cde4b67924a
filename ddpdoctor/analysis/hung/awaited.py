"""Waits charged to what was awaited: a rank that timed out waiting is not the cause.

When ranks wait in a sync point (a barrier, a collective, a ``monitored_barrier``) for a rank
that is elsewhere, running its own code, the wait ends in an error on the waiting side (gloo's
"Timed out waiting", "Rank 1 failed to pass monitoredBarrier", "Connection closed by peer") and
the launcher then stops the awaited rank. The error shows first, but the cause is the awaited
rank and what it was doing: its own function and line (the stack it left as it was stopped, or
the busy record the live watcher kept), for as long as the others waited. The fix is about that
work: shorten it, move it off the path, share it, or give the timeout its real figure.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ddpdoctor.analysis.failed.ledger import build, died_in
from ddpdoctor.analysis.failed.points import Ledger
from ddpdoctor.analysis.failed.stacks import death_stack
from ddpdoctor.analysis.findings import Finding, detector, rank_list
from ddpdoctor.analysis.hung.waits import GENERIC_FIX, fix_for
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run
from ddpdoctor.trace.stacktext import is_user_frame

# Raised records of calls that are no sync point of the ledger's: a data wait, a constructor.
_NOT_POINTS = (schema.DATA_WAIT, schema.DDP_INIT)


@detector
def awaited_work(run: Run) -> Iterable[Finding]:
    ledgers = build(run)
    waiting = {r: lg for r, lg in ledgers.items() if lg.ending.how == "exception" and lg.ending.consequence}
    if not waiting:
        return
    busy = _busy_records(run)
    late = _came_late(waiting, busy)
    for rank in late:
        del waiting[rank]
    for rank, lg in sorted(ledgers.items()):
        if rank in waiting or (lg.ending.how == "exception" and not lg.ending.consequence):
            continue  # a waiter, or a rank that failed on its own (rank_failure names it)
        work = _doing(run, rank, lg, busy, late)
        if work is None:
            continue
        waits = {w: _last_wait(run, w, ledgers[w]) for w in waiting}
        waits = {w: v for w, v in waits.items() if v is not None}
        if not waits:
            continue
        yield _finding(run, rank, work, waits, ledgers, late=rank in late)
        return


def _busy_records(run: Run) -> dict[int, str]:
    """Rank -> where the live watcher saw it busy while others waited on it ("f() file:line")."""
    out: dict[int, str] = {}
    for watch in run.watches:
        for ep in watch.get("waits") or []:
            for r in ep.get("busy") or []:
                where = (ep.get("where") or {}).get(str(r))
                if where:
                    out[int(r)] = str(where)
    return out


def _came_late(waiting: dict[int, Ledger], busy: dict[int, str]) -> set[int]:
    """Ranks that raised a peer's error too, but only after the watcher saw them busy in their
    own code while the others waited: they reached the sync point late, when the others had
    given up (on another node nobody stops them first). One such rank, among ranks that were
    never seen busy, is the one they waited for; more than one, and nothing tells which."""
    seen = {r for r in waiting if r in busy}
    return seen if len(seen) == 1 and len(waiting) > 1 else set()


def _doing(
    run: Run, rank: int, lg: Ledger, busy: dict[int, str], late: set[int] = frozenset()
) -> dict[str, str] | None:
    """What the rank was doing outside every sync point when it was stopped: {function, place},
    from the stack it left (a signal) or the watcher's busy record; None when it was waiting too."""
    if lg.ending.how == "signal":
        if not (run.ends.get(rank) or {}).get("consequence"):
            return None  # killed on its own (a crash, the OOM killer): rank_failure names it
        point, _ = died_in(run, rank, lg)
        if point is not None:
            return None  # it died inside a sync point: it was waiting, not working
        for frame in death_stack(run, rank):
            if is_user_frame(str(frame.get("file", ""))):
                place = f"{os.path.basename(str(frame.get('file')))}:{frame.get('line')}"
                return {"function": str(frame.get("function")), "place": place}
    where = busy.get(rank)
    if where and (lg.ending.how in ("stopped_on_hang", "running") or rank in late):
        function, _, place = where.partition("() ")
        return {"function": function, "place": place or where}
    return None


def _last_wait(run: Run, rank: int, lg: Ledger) -> dict[str, Any] | None:
    """The waiting rank's last sync point, the one it raised in: op, seq, seconds, its line.
    The point is the ledger's (a Python collective, or the gradient all-reduce of a backward
    that raised); its seconds are those of the span that raised (a ``raised`` record), or of
    the last collective when that is the point."""
    trace = run.ranks.get(rank)
    if trace is None or not lg.points:
        return None
    point = lg.points[-1]
    seconds = None
    raised = _raised(trace)
    if raised and (point.raised or point.died_in or point.in_flight):
        seconds = float(raised[-1][2].get("dur_us") or 0) / 1e6
    coll = trace.kind(schema.COLLECTIVE)
    if seconds is None and len(coll) and int(coll.fields[-1][4]) == point.seq:
        seconds = float(coll.dur[-1]) / 1e6
    if seconds is None:
        return None
    return {"op": point.op, "seq": point.seq, "s": seconds, "place": point.site}


def _raised(trace: Any) -> list[tuple[int, int, dict[str, Any]]]:
    """The rank's raised records of sync points (not a data wait's, not a constructor's)."""
    return [r for r in trace.meta.get(schema.RAISED, []) if r[2].get("kind") not in _NOT_POINTS]


def _worked_s(run: Run, rank: int) -> float | None:
    """Seconds from the rank's last recorded event to its end: a lower bound of the work."""
    trace = run.ranks.get(rank)
    end = (run.ends.get(rank) or {}).get("at_wall")
    if trace is None or not end:
        return None
    last_us = 0
    for kind in schema.KINDS:
        ev = trace.kind(kind)
        if len(ev):
            last_us = max(last_us, int((ev.ts + ev.dur).max()))
    start = (int(trace.header.get("wall_ns", 0)) + last_us * 1000) / 1e9
    return max(0.0, float(end) - start)


def _late_worked_s(run: Run, rank: int, lg: Ledger) -> float | None:
    """The longest stretch outside every recorded event between the rank's previous sync point
    and the one it reached late (its raised record): the work the others waited for."""
    trace = run.ranks.get(rank)
    raised = [ts for ts, _, _ in _raised(trace)] if trace is not None else []
    if trace is None or not raised or len(lg.points) < 2:
        return None
    since, until = lg.points[-2].ts, raised[-1]
    spans = []
    for kind in schema.KINDS:
        ev = trace.kind(kind)
        if len(ev):
            keep = (ev.ts >= since) & (ev.ts < until)
            spans += list(zip(ev.ts[keep].tolist(), (ev.ts + ev.dur)[keep].tolist(), strict=True))
    gap, reached = 0, since
    for start, end in sorted(spans):
        gap, reached = max(gap, start - reached), max(reached, end)
    return max(gap, until - reached) / 1e6


def _finding(
    run: Run,
    rank: int,
    work: dict[str, str],
    waits: dict[int, dict[str, Any]],
    ledgers: dict[int, Ledger],
    late: bool = False,
) -> Finding:
    longest = max(w["s"] for w in waits.values())
    worked = _late_worked_s(run, rank, ledgers[rank]) if late else _worked_s(run, rank)
    function, place = work["function"], work["place"]
    sides = "; ".join(
        f"rank {w} waited {v['s']:.1f} s in {v['op']} #{v['seq']}"
        + (f" at {v['place']}" if v["place"] else "")
        + f" and then raised {ledgers[w].ending.describe().removeprefix('raised ')}"
        for w, v in sorted(waits.items())
    )
    ran = f" (it had run {worked:.1f} s since its last sync point when it was stopped)" if worked else ""
    if late and worked:
        ran = f" for {worked:.1f} s, and reached the sync point only after the others had given up,"
    summary = (
        f"rank {rank} was running {function}() at {place}{ran} while the others waited for it: "
        f"{sides}. Their errors are consequences: the cause is the work on rank {rank}"
    )
    need = max(longest, worked or 0.0)
    specific = fix_for(function)
    ways = "" if specific == GENERIC_FIX else f"{specific}; or "
    ops = {v["op"] for v in waits.values()}
    knob = "init_process_group(timeout=...)"
    if ops == {"monitored_barrier"}:
        knob = "monitored_barrier(timeout=...)"
    fix = (
        f"The other ranks waited {longest:.1f} s for {function}() on rank {rank} ({place}): {ways}"
        "shorten it, move it off the other ranks' path (before init_process_group, into a "
        "background thread), run it on every rank (each its share), or raise the timeout above "
        f"the work's duration ({knob}: it was {longest:.0f} s, the work took more than {need:.0f} s)."
    )
    return Finding(
        "awaited_work",
        "error",
        [rank],
        summary,
        fix=fix,
        details={
            "root_rank": rank,
            "place": place,
            "function": function,
            "worked_s": round(worked, 3) if worked else None,
            "waiting": sorted(waits),
            "waits": {str(w): v for w, v in waits.items()},
            "waited_s": round(longest, 3),
            "waiting_ranks": rank_list(sorted(waits)),
        },
    )
