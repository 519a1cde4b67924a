"""A rank blocked in its own code on work another of its threads was to do, after that thread
died of an exception: the wait never ends, and the thread's error is the cause.

The hang's stacks say where the rank waits (a standard-library primitive right under its own
line: ``Queue.join``, ``Event.wait``, ``Future.result``); the rank's trace holds the exception
that ended each thread that died of one (``rank_error`` from ``threading.excepthook``, with the
thread's name). Both must hold before the thread is named, and the finding says what each
fact is, not that this thread's work was the one awaited.
"""

from __future__ import annotations

import os
from typing import Any

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run
from ddpdoctor.trace.stacktext import is_user_frame

# Where the standard library waits for another thread: these modules, or this package.
_WAITS = ("threading.py", "queue.py")
_FUTURES = os.sep + os.path.join("concurrent", "futures", "")


def _wait(frames: list[dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """(the primitive, the user's frame that called it) when the innermost user frame of a
    stack (innermost first) calls into a waiting primitive."""
    for i, frame in enumerate(frames):
        if is_user_frame(str(frame.get("file", ""))):
            below = frames[i - 1] if i > 0 else {}
            file = str(below.get("file", ""))
            if os.path.basename(file) in _WAITS or _FUTURES in file:
                return str(below.get("function", "")), frame
            return None
    return None


def _place(info: dict[str, Any]) -> str:
    """'file.py:51 in _run()': the innermost user frame of a recorded exception."""
    for file, line, function in reversed(info.get("frames") or []):
        if is_user_frame(str(file)):
            return f"{os.path.basename(str(file))}:{line} in {function}()"
    return ""


def dead_thread(finding: Finding, run: Run) -> Finding:
    """Name the thread whose death a rank stuck in its own code waits on, when the facts say so."""
    if finding.details.get("pattern") != "user_code":
        return finding
    for rank in finding.ranks:
        trace = run.ranks.get(rank)
        state = (finding.details.get("ranks") or {}).get(str(rank)) or {}
        waiting = _wait(state.get("stack") or [])
        if trace is None or waiting is None:
            continue
        died = [
            (step, info)
            for _, step, info in trace.meta.get(schema.RANK_ERROR, [])
            if info.get("thread") not in (None, "", "MainThread")
        ]
        if not died:
            continue
        step, info = died[-1]
        thread, error = str(info["thread"]), f"{info.get('type')}: {info.get('message')}"
        at = _place(info)
        where = f" at {at}" if at else ""
        user = waiting[1]
        line = f"{os.path.basename(str(user.get('file')))}:{user.get('line')}"
        finding.summary += (
            f" It waits in {waiting[0]}() ({line}) for work of a thread that died: its thread "
            f"'{thread}' raised {error}{where} (step {step}), so that work never comes."
        )
        finding.fix = (
            f"The thread '{thread}' died of {info.get('type')}{where}: fix that error, and catch "
            "errors inside the thread's loop so that it still marks each item done "
            "(queue.task_done() in a finally) or reports the failure, or check that the thread "
            f"is alive (or wait with a timeout) before {waiting[0]}()."
        )
        finding.details["dead_thread"] = {"rank": rank, "thread": thread, "error": error, "place": at,
                                          "step": step, "waits_in": waiting[0]}  # fmt: skip
        break
    return finding
