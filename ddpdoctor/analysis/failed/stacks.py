"""Where a rank was last seen in the user's code: its hang's stack, the stack it left as a
signal killed it (faulthandler), or its exception's traceback."""

from __future__ import annotations

import linecache
import os
import sysconfig
from typing import TYPE_CHECKING, Any

from ddpdoctor.trace.reader import Run
from ddpdoctor.trace.stacktext import is_user_frame

if TYPE_CHECKING:
    from ddpdoctor.analysis.failed.points import Ledger

Frame = tuple[str, int, str]  # a stack's frame: (path, line, function as the stack names it)


def user_frame(frames: list[dict[str, Any]]) -> str:
    """The innermost frame of the user's code in a stack (innermost first), as file:line."""
    for frame in frames:
        if _is_users(str(frame.get("file", ""))):
            return f"{os.path.basename(str(frame.get('file', '')))}:{frame.get('line')}"
    return ""


def user_frames(frames: list[dict[str, Any]]) -> list[Frame]:
    """The user's frames of a stack (innermost first) as (path, line, function), outermost first."""
    return [
        (
            str(f.get("file", "")),
            int(f["line"]) if isinstance(f.get("line"), int) else -1,
            str(f.get("function", "")),
        )
        for f in reversed(frames)
        if _is_users(str(f.get("file", "")))
    ]


_STDLIB = (sysconfig.get_paths().get("stdlib") or "/nonexistent") + os.sep


def _is_users(file: str) -> bool:
    path = os.path.abspath(file)
    return is_user_frame(path) and not path.startswith(_STDLIB)


def hang_frames(summary: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """A rank's main-thread frames (innermost first) in a hang summary's stacks, or []."""
    threads = ((summary.get("stacks") or {}).get(str(rank)) or {}).get("threads") or []
    for thread in threads:
        if thread.get("name") == "MainThread" or len(threads) == 1:
            return list(thread.get("frames") or [])
    return []


def error_frames(ledger: Ledger) -> list[dict[str, Any]]:
    """The traceback of what the rank raised (innermost first), [] if it raised nothing."""
    if ledger.ending.how != "exception" or not ledger.ending.error:
        return []
    return _innermost_first(ledger.ending.error.get("frames") or [])


def _innermost_first(raw: list[Any]) -> list[dict[str, Any]]:
    """Recorded frames (file, line, function), outermost first, as stack frames innermost first."""
    return [
        {"file": str(f[0]), "line": f[1], "function": str(f[2])}
        for f in reversed(raw)
        if isinstance(f, (list, tuple)) and len(f) >= 3
    ]


def death_stack(run: Run, rank: int) -> list[dict[str, Any]]:
    """The main thread's frames (innermost first) in the stack a rank left as it died, or []."""
    end = run.ends.get(rank) or {}
    if not end.get("stack"):
        return []
    from ddpdoctor.trace.stacktext import parse_faulthandler

    threads = parse_faulthandler(str(end["stack"]))
    main = next((t for t in threads if t.get("name") == "MainThread"), None)
    return list(main.get("frames") or []) if main else []


def exit_stack(run: Run, rank: int) -> list[dict[str, Any]]:
    """Where a rank that left on its own (sys.exit, os._exit) made the call (innermost first), or []."""
    end = run.ends.get(rank) or {}
    if end.get("how") not in ("exit", "os_exit"):
        return []
    return _innermost_first(end.get("frames") or [])


def last_frames(run: Run, rank: int, ledger: Ledger) -> list[dict[str, Any]]:
    """Where the rank was last seen: the last hang's stack, else the stack it died with, else
    where it called sys.exit or os._exit, else its exception's traceback (innermost first)."""
    frames = hang_frames(run.hangs[-1], rank) if run.hangs else []
    if not frames and (run.ends.get(rank) or {}).get("how") == "signal":
        frames = death_stack(run, rank)
    return frames or exit_stack(run, rank) or error_frames(ledger)


def raised_where(frames: list[Any], handler: Any = None) -> str:
    """Where it was raised: ' (train.py:40 in main)', or ' (train.py:40 in main, inside
    serialization.py:828 in __init__)' when in a library the user's line called. What one of
    the rank's signal handlers raised (``handler``: the handler's frame) is placed where the
    signal came in: ' (train.py:33 in backward, where the signal handler on_alarm
    (train.py:50) raised it)'."""
    if isinstance(handler, int) and 0 < handler < len(frames):
        ran = raised_where(frames[:handler]).rstrip(")")
        file, line, func = (list(frames[handler]) + ["?", "?", "?"])[:3]
        return f"{ran}, where the signal handler {func} ({os.path.basename(str(file))}:{line}) raised it)"
    if not frames:
        return ""
    inner = frame_text(frames[-1])
    user = next((f for f in reversed(frames) if is_user_frame(str(list(f)[0]))), None)
    if user is None or user is frames[-1]:
        return f" ({inner})"
    return f" ({frame_text(user)}, inside {inner})"


def user_code(frames: list[Any]) -> str:
    """The source of the user's innermost line in recorded frames (file, line, function),
    outermost first, as the file on disk has it now; "" where it cannot be read."""
    user = next((f for f in reversed(frames) if is_user_frame(str(list(f)[0]))), None)
    if user is None or len(user) < 2 or not isinstance(user[1], int):
        return ""
    line = linecache.getline(str(user[0]), user[1]).strip()
    return line.split("  #")[0] if not line.startswith("#") else ""  # an inline comment, PEP 8's way


def recorded_place(frames: list[Any]) -> str:
    """The user's innermost line (file:line) of recorded frames (file, line, function), outermost first."""
    return user_frame([{"file": f[0], "line": f[1]} for f in reversed(frames)])


def frame_text(frame: Any) -> str:
    file, line, func = (list(frame) + ["?", "?", "?"])[:3]
    return f"{os.path.basename(str(file))}:{line} in {func}"
