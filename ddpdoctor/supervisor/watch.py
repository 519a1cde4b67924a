"""Live supervision inside `ddpdoctor run`: read each rank's status file, catch hangs and deaths.

A thread polls ``status-rank{R}.json`` (written by every rank's trace writer thread, see
``probes/liveness.py``). A hang is
  * a rank inside a sync point (collective, barrier, DDP forward's buffer broadcast, backward's
    gradient all-reduce) for longer than the threshold, or
  * after the first step, no rank recording anything for longer than the threshold.
The default threshold adapts: ``HANG_MULTIPLE`` times the slowest step any rank has seen, never
below the floor. On a hang it dumps every rank's stack (stacks.py), diagnoses (analysis/hang.py),
writes ``hang-N/`` and prints the report on stderr; with ``on_hang="kill"`` it then stops the job.
It also notes ranks that vanish (killed by a signal) for the ``rank_failure`` finding.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpdoctor.analysis import flight
from ddpdoctor.analysis.hang import SYNC_PHASES, analyse
from ddpdoctor.rundir import RunDir, write_atomic
from ddpdoctor.supervisor import stacks as _stacks

WATCH_SCHEMA = "ddpdoctor.watch/1"
HANG_SCHEMA = "ddpdoctor.hang/1"
DEFAULT_FLOOR_S = 30.0
HANG_MULTIPLE = 5.0


def read_statuses(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The latest status of every rank (a file being replaced is simply read next time)."""
    out: dict[int, dict[str, Any]] = {}
    for rank, path in RunDir(run_dir).statuses():
        try:
            with open(path, encoding="utf-8") as fh:
                status = json.load(fh)
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
    if not phase or phase.get("name") not in SYNC_PHASES:
        return 0.0
    return float(phase.get("since_s", 0.0)) + max(0.0, now - float(status.get("heartbeat_wall") or now))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead: its parent (torchrun) has not reaped it yet
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _zombie_signal(pid: int) -> int | None:
    """The signal that killed ``pid`` if it is still a zombie (Linux /proc/PID/stat exit_code)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[-1].split()
        code = int(fields[-1])  # field 52: the status waitpid would report
    except (OSError, ValueError, IndexError):
        return None
    return code & 0x7F or None


class Watcher:
    """The supervision thread; ``start()`` after launching, ``stop()`` when the job has ended."""

    def __init__(
        self,
        run_dir: Path,
        *,
        hang_timeout: float | None = None,
        on_hang: str = "dump",
        floor_s: float = DEFAULT_FLOOR_S,
        multiple: float = HANG_MULTIPLE,
        poll_s: float = 0.25,
        report: Callable[[str], None] | None = None,
        kill_job: Callable[[list[int]], None] | None = None,
        use_pyspy: bool = True,
        since_wall: float | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.hang_timeout = hang_timeout
        self.on_hang = on_hang
        self.floor_s = floor_s
        self.multiple = multiple
        self.poll_s = poll_s
        self.report = report or (lambda text: None)
        self.kill_job = kill_job
        self.use_pyspy = use_pyspy
        self.hangs: list[dict[str, Any]] = []
        self.exits: dict[int, dict[str, Any]] = {}
        self.errors: dict[int, dict[str, Any]] = {}
        self.killed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ddpdoctor-watch", daemon=True)
        self._last_events: dict[int, int] = {}
        self._last_change = time.time()
        # Statuses with an older heartbeat belong to an earlier run in a reused --out dir.
        self._started_wall = time.time() - 1.0 if since_wall is None else since_wall
        self._armed = True
        self._statuses: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 15.0) -> None:
        """Stop watching; waits for a diagnosis in progress so its files are complete."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with contextlib.suppress(Exception):
            self.poll_once(time.time(), detect=False)  # last look: catch a final rank death
        self._write_watch()

    @property
    def hung(self) -> bool:
        """A hang was reported and the job has not moved since."""
        return bool(self.hangs) and not self._armed

    def rank_pids(self) -> list[int]:
        return [int(s.get("pid") or 0) for s in self._statuses.values()]

    def threshold(self, statuses: dict[int, dict[str, Any]]) -> float:
        if self.hang_timeout is not None:
            return self.hang_timeout
        return adaptive_threshold(statuses, self.floor_s, self.multiple)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once(time.time())
            except Exception as exc:  # the supervisor's own bug must not end supervision quietly
                self.report(f"ddpdoctor: hang watch failed: {exc!r}")
                return

    def poll_once(self, now: float, detect: bool = True) -> dict[str, Any] | None:
        """One look at the ranks; returns the hang summary if this look caught one."""
        with self._lock:
            statuses = {
                r: st
                for r, st in read_statuses(self.run_dir).items()
                if float(st.get("heartbeat_wall") or 0.0) >= self._started_wall
            }
            if not statuses:
                return None
            self._statuses = statuses
            changed = False
            failing = False  # a rank of the current attempt died or raised: not a hang
            for rank, st in statuses.items():
                events = int(st.get("events") or 0)
                if self._last_events.get(rank) != events:
                    self._last_events[rank] = events
                    changed = True
                if st.get("error") and rank not in self.errors:
                    self.errors[rank] = {"seen_wall": now, **st["error"], "others": _snapshot(statuses, rank)}
                    self._write_watch()
                pid = int(st.get("pid") or 0)
                alive = pid_alive(pid) if pid else True
                failing = failing or not alive or bool(st.get("error"))
                if pid and rank not in self.exits and not alive:
                    sig = _zombie_signal(pid)
                    self.exits[rank] = {
                        "pid": pid,
                        "seen_wall": now,
                        "signal": sig,
                        "step": st.get("step"),
                        "last_heartbeat_wall": st.get("heartbeat_wall"),
                        "error": st.get("error"),
                        "others": _snapshot(statuses, rank),
                    }
                    self._write_watch()
            if changed:
                self._last_change = now
            threshold = self.threshold(statuses)
            longest = max((sync_wait_s(s, now) for s in statuses.values()), default=0.0)
            quiet = now - self._last_change
            if not self._armed and changed and longest <= threshold:
                # Every rank is out of the stuck sync point and moving: the job recovered.
                self._armed = True
                if self.hangs:
                    self.hangs[-1]["recovered"] = True
                    self._save_hang(self.hangs[-1])
            if not detect or not self._armed or failing:
                return None
            started = any(int(s.get("step", -1)) >= 1 for s in statuses.values())
            if longest <= threshold and not (started and quiet > threshold):
                return None
            self._armed = False
        return self._on_hang(statuses, threshold, max(longest, quiet if started else 0.0), now)

    def _on_hang(
        self, statuses: dict[int, dict[str, Any]], threshold: float, quiet: float, now: float
    ) -> dict[str, Any]:
        n = len(self.hangs) + 1
        hang_dir = RunDir(self.run_dir).hang(n)
        hang_dir.mkdir(exist_ok=True)
        stacks = _stacks.dump_all(statuses, self.use_pyspy)
        world = max((int(s.get("world_size") or 0) for s in statuses.values()), default=0) or None
        diag = analyse(statuses, stacks, threshold_s=threshold, quiet_s=quiet, now=now, world_size=world)
        text = diag.text(str(hang_dir)) + flight.on_hang(self.run_dir, hang_dir, statuses)
        summary = {
            "schema": HANG_SCHEMA,
            "n": n,
            "detected_wall": now,
            "threshold_s": threshold,
            "quiet_s": round(quiet, 3),
            "world_size": world,
            "action": self.on_hang,
            "hang_dir": str(hang_dir),
            "statuses": {str(r): s for r, s in statuses.items()},
            "stacks": {str(r): s for r, s in stacks.items()},
            "text": text,
            "reported_wall": time.time(),
            "recovered": False,
        }
        for rank, dump in stacks.items():
            raw = dump.get("text") or json.dumps(dump.get("threads", []), indent=1)
            with contextlib.suppress(OSError):
                RunDir(self.run_dir).hang_stack(n, rank).write_text(_render_stack(rank, dump, raw))
        self._save_hang(summary)
        self.hangs.append(summary)
        self.report(text)
        self._write_watch()
        if self.on_hang == "kill" and self.kill_job is not None:
            self.killed = True
            self.report("ddpdoctor: --on-hang kill: stopping the job")
            self.kill_job([int(s.get("pid") or 0) for s in statuses.values()])
        return summary

    def _save_hang(self, summary: dict[str, Any]) -> None:
        path = Path(summary["hang_dir"]) / RunDir.HANG_SUMMARY
        _write_json(path, summary)

    def _write_watch(self) -> None:
        _write_json(
            self.run_dir / RunDir.WATCH,
            {
                "schema": WATCH_SCHEMA,
                "hang_timeout": self.hang_timeout,
                "on_hang": self.on_hang,
                "hangs": [h["hang_dir"] for h in self.hangs],
                "killed_on_hang": self.killed,
                "rank_exits": {str(r): e for r, e in self.exits.items()},
                "rank_errors": {str(r): e for r, e in self.errors.items()},
            },
        )


def _snapshot(statuses: dict[int, dict[str, Any]], but: int) -> dict[str, Any]:
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


def _render_stack(rank: int, dump: dict[str, Any], raw: str) -> str:
    lines = [f"rank {rank}: stack by {dump.get('method') or 'nothing'} {dump.get('error') or ''}".rstrip()]
    for t in dump.get("threads") or []:
        lines.append(f"\nThread {t.get('name')} (most recent call first):")
        for f in t.get("frames") or []:
            lines.append(f'  File "{f.get("file")}", line {f.get("line")}, in {f.get("function")}')
    return "\n".join(lines) + "\n"


def _write_json(path: Path, obj: Any) -> None:
    with contextlib.suppress(OSError):
        write_atomic(path, json.dumps(obj, indent=1, default=str))


def stop_job(launcher_pid: int, rank_pids: list[int], grace_s: float = 5.0) -> None:
    """Stop a hung job: ranks blocked in a collective ignore SIGTERM until it returns, so they
    get SIGKILL (their traces are flushed continuously and their stacks are already taken);
    the launcher then sees its workers fail and exits; if not, SIGTERM, then SIGKILL its group."""
    for pid in rank_pids:
        if pid > 0:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            with contextlib.suppress(OSError):
                if sig == signal.SIGKILL:
                    os.killpg(launcher_pid, sig)
                else:
                    os.kill(launcher_pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not pid_alive(launcher_pid):
                return
            time.sleep(0.1)
