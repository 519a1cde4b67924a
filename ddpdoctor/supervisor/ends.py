"""After the job: complete each rank's trace from its ring, and say how each rank ended.

A rank killed between two flushes of its trace left its last events in its memory-mapped ring
(trace/ring.py); ``settle`` appends them to the trace. It then writes ``ends.json``: per rank,
how it ended (a clean exit, an exception, ``os._exit(code)``, a signal by name), the source
of that end where it can be known, and its dying words (the last lines it wrote to stderr),
from the files each rank left (probes/lastwords.py) and what the watcher saw. A rank that
vanished leaving none of them was killed by SIGKILL (nothing else ends a process without a
trace); it is called an OOM kill only when the kernel log names its pid.

``ends.json``::

    {"schema": "ddpdoctor.ends/1", "completed": {trace file: {recovered, lost}},
     "ranks": {"R": {pid, how: exit|exception|os_exit|signal, code (an exit's status where
                     known), signal, source,
                     consequence, at_wall, stack, words: [lines]}},
     "first": R or null}
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from ddpdoctor.probes.lastwords import filename
from ddpdoctor.rundir import RunDir, write_atomic
from ddpdoctor.trace import schema
from ddpdoctor.trace.ring import complete_trace, ring_path

ENDS_FILE = RunDir.ENDS
ENDS_SCHEMA = "ddpdoctor.ends/1"
WORDS = 12  # dying words kept per rank: the last non-empty lines of its stderr
_FATAL = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
_OOM_PID = re.compile(rb"(?:Killed process |oom-kill:.*?\bpid=)(\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def settle(run_dir: Path, wait_s: float = 5.0) -> dict[str, Any]:
    """Complete the traces and write ends.json; never raises (returns what it could)."""
    out: dict[str, Any] = {"schema": ENDS_SCHEMA, "completed": {}, "ranks": {}, "first": None}
    deadline = time.monotonic() + wait_s
    while any(run_dir.glob("stderr-rank*.open")) and time.monotonic() < deadline:
        time.sleep(0.05)  # the tees write their last bytes once every holder of the pipe exits
    for trace in RunDir(run_dir).all_traces():
        try:
            done = complete_trace(str(trace))
        except Exception as exc:
            done = {"error": repr(exc)}
        if done:
            out["completed"][trace.name] = done
    try:
        out["ranks"], out["first"] = rank_ends(run_dir)
    except Exception as exc:
        out["error"] = repr(exc)
    with contextlib.suppress(OSError):
        write_atomic(run_dir / ENDS_FILE, json.dumps(out, indent=1))
    return out


def settle_unsupervised(run_dir: Path) -> bool:
    """Settle a run that no ``ddpdoctor run`` settled (``ddpdoctor.instrument()`` in the script,
    or a supervisor that was itself killed), once its ranks are gone: without this, a rank that
    died keeps its last events in its ring and ``diagnose`` would not see them. Only when no
    ends.json exists and every unfinished trace's process is on this host and no longer alive
    (a rank on another host, or alive here, may still be writing); never raises."""
    try:
        if (run_dir / ENDS_FILE).exists():
            return False
        unfinished = []
        for trace in RunDir(run_dir).all_traces():
            if not os.path.exists(ring_path(trace)):
                continue
            header, clean, _, _ = _trace_facts(trace)
            if not clean:
                unfinished.append(header)
        if not unfinished:
            return False
        for header in unfinished:
            if header.get("host") != socket.gethostname() or _alive(int(header.get("pid") or 0)):
                return False
        settle(run_dir, wait_s=0.0)
        return True
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return False


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # unknown: assume it may still be writing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _read(path: Path, limit: int = 1 << 20) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def dying_words(text: str, lines: int = WORDS) -> list[str]:
    """The last non-empty lines of a stderr tail, without terminal colour codes."""
    kept = [_ANSI.sub("", ln).rstrip() for ln in text.replace("\r", "\n").splitlines()]
    return [ln for ln in kept if ln.strip()][-lines:]


def _trace_facts(path: Path) -> tuple[dict[str, Any], bool, dict[str, Any] | None, float | None]:
    """(header, ended cleanly, first main-thread rank_error, last event's wall time: a rank that
    vanished died right after it) of a trace; ValueError if it cannot be read."""
    from ddpdoctor.trace.reader import TraceError, read_trace

    try:
        trace = read_trace(path)
    except TraceError as exc:
        raise ValueError(str(exc)) from None
    errors = trace.meta.get(schema.RANK_ERROR, [])
    error = next((info for _, _, info in errors if info.get("thread") == "MainThread"), None)
    ends = [int(ev.end.max()) for ev in trace.events.values() if len(ev)]
    # Metadata was written by a live rank too, and a ``raised`` record closes a span: a backward
    # that waited 1.8 s in its all-reduce for a peer that had left, then raised, was alive at
    # its end, long after its last event.
    ends += [int(ts) + _span_us(info) for kind in trace.meta.values() for ts, _, info in kind]
    last = max(ends, default=None)
    wall = None if last is None else (trace.header["wall_ns"] / 1e3 + last) / 1e6
    return trace.header, trace.ended_cleanly, error, wall


def _span_us(info: Any) -> int:
    span = info.get("dur_us") if isinstance(info, dict) else None
    return int(span) if isinstance(span, (int, float)) and span > 0 else 0


def _watch_exits(run_dir: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((run_dir / RunDir.WATCH).read_text()).get("rank_exits") or {}
    return {}


def oom_killed_pids() -> set[int] | None:
    """Pids the kernel log says the OOM killer took; None when the log cannot be read."""
    try:
        proc = subprocess.run(["dmesg"], capture_output=True, timeout=3, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return {int(m) for m in _OOM_PID.findall(proc.stdout)}


def _one_end(run_dir: Path, rank: int, header: dict[str, Any], clean: bool, error: Any) -> dict[str, Any]:
    end: dict[str, Any] = {"pid": header.get("pid"), "how": None, "code": None, "signal": None}
    end["words"] = dying_words(_read(run_dir / filename("stderr", rank)))
    fatal_path, term_path = run_dir / filename("fatal", rank), run_dir / filename("sigterm", rank)
    fatal, term = _read(fatal_path), _read(term_path)
    exit_info: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        exit_info = json.loads((run_dir / filename("exit", rank)).read_text())
    if fatal.strip():
        first = fatal.strip().splitlines()[0]
        name = next((sig for text, sig in _FATAL.items() if text in first), None)
        end.update(how="signal", signal=name, stack=fatal[-8000:], at_wall=_mtime(fatal_path))
        cpp = any("terminate called" in w for w in end["words"])
        end["source"] = (
            "an uncaught C++ exception (std::terminate)"
            if cpp and name == "SIGABRT"
            else "a fatal error inside the rank"
        )
    elif error is not None:
        end.update(how="exception", code=1, at_wall=(error.get("wall_ns") or 0) / 1e9 or None)
        from ddpdoctor.analysis.findings import clip

        end["source"] = f"{error.get('type')}: {clip(str(error.get('message', '')).splitlines()[0], 200)}"
    elif term.strip():
        end.update(how="signal", signal="SIGTERM", stack=term[-8000:], at_wall=_mtime(term_path))
    elif exit_info.get("how") == "os._exit":
        end.update(how="os_exit", code=exit_info.get("code"), at_wall=(exit_info.get("wall_ns") or 0) / 1e9)
        end["source"] = "os._exit() in the rank"
        end["frames"] = exit_info.get("frames") or []  # its caller's stack, outermost first
    elif clean or exit_info.get("how") == "exit":
        trace = RunDir(run_dir).trace(rank, header.get("restart", 0))
        end.update(how="exit", code=exit_info.get("code"), at_wall=(exit_info.get("wall_ns") or 0) / 1e9)
        end["at_wall"] = end["at_wall"] or _mtime(trace)
        called = exit_info.get("called") or {}
        if called.get("code") == end["code"] and end["code"] is not None:  # not a call it caught
            end["frames"] = called.get("frames") or []  # sys.exit's caller, outermost first
        if end["code"] and clean:
            end["source"] = "sys.exit() or SystemExit in the rank, with no traceback"
        elif end["code"]:  # its trace was never closed: Python's own exit never ran
            end["source"] = "exit() called in native code, not Python's own exit"
    return end


def rank_ends(run_dir: Path) -> tuple[dict[str, Any], int | None]:
    """How every rank of this run dir ended, and which failure came first."""
    exits = _watch_exits(run_dir)
    ends: dict[str, Any] = {}
    for path in RunDir(run_dir).traces().values():  # the newest attempt, regular files only
        try:
            header, clean, error, last_wall = _trace_facts(path)
        except (OSError, ValueError, IndexError):
            continue
        rank = int(header["rank"])
        end = _one_end(run_dir, rank, header, clean, error)
        seen = exits.get(str(rank)) or {}
        if end["how"] is None:  # vanished without a word: only SIGKILL does that
            sig = seen.get("signal")
            name = signal.Signals(sig).name if sig in signal.valid_signals() else "SIGKILL"
            end.update(how="signal", signal=name, at_wall=last_wall or seen.get("seen_wall") or _mtime(path))
            end["inferred"] = seen.get("signal") is None
        ends[str(rank)] = end
    _never_ranks(run_dir, ends, exits)
    _sources(ends)
    _interrupted(run_dir, ends)
    failed = [
        (e.get("at_wall") or 0.0, int(r))
        for r, e in ends.items()
        if (e["how"] != "exit" or e.get("code") or e.get("initialised") is False)
        and not e["consequence"]
        and not e.get("interrupted")
    ]
    return ends, (min(failed)[1] if failed else None)


def _never_ranks(run_dir: Path, ends: dict[str, Any], exits: dict[str, Any]) -> None:
    """Ranks whose process started (``proc-rank{R}.json``, probes/early.py) but left no trace
    that can be read: most never got through init_process_group (``initialised: False``); one
    whose record says it did had a trace it could not write (a full disk). How each ended, from
    the same files; a process that went through Python's exit on its own ended there."""
    for rank, path in RunDir(run_dir).procs().items():
        if str(rank) in ends:
            continue
        try:
            proc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(proc, dict):
            continue
        error = proc.get("error") if isinstance(proc.get("error"), dict) else None
        end = _one_end(run_dir, rank, proc, bool(proc.get("exit_wall")) and error is None, error)
        initialised = proc.get("initialised") is True  # written at its Python exit
        end.update(
            initialised=initialised, world_size=proc.get("world_size"), started=proc.get("started_wall")
        )
        if end["how"] == "exit":
            code = f" with exit code {end['code']}" if end["code"] else ""
            source = (
                f"{'an exit' + code if code else 'a clean exit'}; its trace could not be read"
                if initialised
                else f"it exited{code} before init_process_group"
            )
            end.update(at_wall=proc.get("exit_wall") or end.get("at_wall"), source=source)
        elif end["how"] is None:  # no Python exit, no stack, no exception: SIGKILL
            sig = (exits.get(str(rank)) or {}).get("signal")
            name = signal.Signals(sig).name if sig in signal.valid_signals() else "SIGKILL"
            end.update(how="signal", signal=name, at_wall=_mtime(path), inferred=sig is None)
        ends[str(rank)] = end


def _interrupted(run_dir: Path, ends: dict[str, Any]) -> None:
    """The user pressed Ctrl-C on a hung job: ddpdoctor SIGKILLed its ranks (blocked in a
    collective, they would not act on SIGINT). Those kills are the interrupt, no rank's failure."""
    from ddpdoctor.trace.reader import read_meta

    at = read_meta(run_dir).get(RunDir.INTERRUPTED_HUNG)
    if not isinstance(at, int):
        return
    for end in ends.values():
        if end["how"] == "signal" and end["signal"] == "SIGKILL" and end.get("inferred", True):
            end.update(
                interrupted=True, consequence=False, at_wall=at / 1e9,
                source="ddpdoctor, on the user's interrupt (Ctrl-C) of the hung job",
            )  # fmt: skip


def _sources(ends: dict[str, Any]) -> None:
    """Name who ended each killed rank where we can, and mark the consequences of a failure."""
    oom: set[int] | None | bool = False  # not read yet
    own = {
        r: e.get("at_wall") or 0.0
        for r, e in ends.items()
        if e["how"] in ("signal", "exception", "os_exit")
        # an exit with an error code, or one before the others could reach init_process_group
        or (e["how"] == "exit" and (e.get("code") or e.get("initialised") is False))
    }
    for rank, end in ends.items():
        end["consequence"] = False
        earlier = [r for r, t in own.items() if r != rank and t and t < (end.get("at_wall") or 0.0)]
        if end["how"] == "exception":
            from ddpdoctor.analysis.failed.endings import is_consequence

            end["consequence"] = bool(earlier) and is_consequence(
                {"type": "", "message": end.get("source", "")}
            )
        if end["how"] != "signal" or end.get("source"):
            continue
        if end["signal"] == "SIGTERM":
            if earlier:
                end.update(source=f"the launcher stopping it after rank {min(earlier, key=own.get)} failed")
                end["consequence"] = True
            else:
                end["source"] = "sent from outside the rank (the launcher, a scheduler, or a user)"
        elif end["signal"] == "SIGKILL":
            if oom is False:
                oom = oom_killed_pids()
            if oom is None:
                end["source"] = (
                    "unknown: the kernel log is not readable here, so an OOM kill cannot be told apart"
                )
            elif end.get("pid") in oom:
                end["source"] = "the kernel's OOM killer (the kernel log names this pid)"
            elif earlier:
                end.update(
                    source=f"the launcher, after rank {min(earlier, key=own.get)} failed", consequence=True
                )
            else:
                end["source"] = "not the OOM killer (the kernel log does not name this pid)"
