"""Live supervision inside `ddpdoctor run`: read each rank's status file, catch hangs and deaths.

A thread polls ``status-rank{R}.json`` (written by every rank's trace writer thread, see
``probes/liveness.py``) and hands each look to the pure ``analysis/proof.judge``, measuring the
ranks' CPU time and stacks (``activity.py``) only while someone waits or nothing is recorded:
  * proven (every live rank blocked, and they disagree, or a peer left): a hang at once;
  * stalled (a rank outside sync points does not move) or blocked in one consistent collective:
    a hang once the threshold passes;
  * busy (the rank the others wait for progresses): a live note (``waits.py``), and a hang only
    past ``--hang-timeout`` when the user set one.
The default threshold adapts: ``HANG_MULTIPLE`` times the slowest step any rank has seen, never
below the floor. On a hang it dumps every rank's stack (stacks.py), diagnoses (analysis/hang.py),
writes ``hang-N/`` and prints the report on stderr; with ``on_hang="kill"`` it then stops the job.
It also notes ranks that vanish (killed by a signal, or gone on their own) for ``rank_failure``.
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
from ddpdoctor.analysis.proof import ATOMIC, SYNC, Activity, Verdict, judge, phase_since
from ddpdoctor.rundir import RunDir, write_atomic
from ddpdoctor.supervisor import stacks as _stacks
from ddpdoctor.supervisor.activity import ActivityTracker, pid_alive, pyspy_sample, zombie_signal
from ddpdoctor.supervisor.waits import WaitNotes

WATCH_SCHEMA = "ddpdoctor.watch/1"
HANG_SCHEMA = "ddpdoctor.hang/1"
DEFAULT_FLOOR_S = 30.0
FRESH_S = 1.0
LOOK_SHARE = 5.0  # wait at least this many times as long as the last look took
HANG_MULTIPLE = 5.0


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
    if not phase or phase.get("name") not in SYNC_PHASES:
        return 0.0
    return float(phase.get("since_s", 0.0)) + max(0.0, now - float(status.get("heartbeat_wall") or now))


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
        self._rank_change: dict[int, float] = {}  # when each rank last recorded an event
        self._tracker = ActivityTracker(dump=pyspy_sample if use_pyspy else None)
        self._notes = WaitNotes(self.run_dir, on_change=self._write_watch)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 15.0) -> None:
        """Stop watching; waits for a diagnosis in progress so its files are complete."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with contextlib.suppress(Exception):
            self.poll_once(time.time(), detect=False)  # last look: catch a final rank death
        with self._lock:
            self._notes.close(time.time())
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
        interval = self.poll_s
        while not self._stop.wait(interval):
            try:
                t0 = time.perf_counter()
                self.poll_once(time.time())
                # Thousands of ranks: look less often rather than take more than ~1/5 of a core.
                interval = max(self.poll_s, LOOK_SHARE * (time.perf_counter() - t0))
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
            failing = False  # a rank of the current attempt raised: a failure, not a hang
            alive: dict[int, bool] = {}
            for rank, st in statuses.items():
                events = int(st.get("events") or 0)
                if self._last_events.get(rank) != events:
                    self._last_events[rank] = events
                    self._rank_change[rank] = now
                    changed = True
                if st.get("error") and rank not in self.errors:
                    self.errors[rank] = {"seen_wall": now, **st["error"], "others": _snapshot(statuses, rank)}
                    self._write_watch()
                pid = int(st.get("pid") or 0)
                # A heartbeat written in the last second is proof of life, and costs no syscall.
                fresh = now - float(st.get("heartbeat_wall") or 0.0) < FRESH_S and not st.get("exited")
                alive[rank] = True if fresh or not pid else pid_alive(pid)
                failing = failing or bool(st.get("error"))
                if pid and rank not in self.exits and not alive[rank]:
                    self.exits[rank] = {
                        "pid": pid,
                        "seen_wall": now,
                        "signal": zombie_signal(pid),
                        "exited": bool(st.get("exited")),
                        "step": st.get("step"),
                        "last_heartbeat_wall": st.get("heartbeat_wall"),
                        "error": st.get("error"),
                        "others": _snapshot(statuses, rank),
                    }
                    self._write_watch()
            if changed:
                self._last_change = now
            threshold = self.threshold(statuses)
            quiet = now - self._last_change
            verdict = self._judge(statuses, alive, now, quiet)
            longest = max((sync_wait_s(s, now) for r, s in statuses.items() if alive[r]), default=0.0)
            if not self._armed and changed and longest <= threshold and verdict.state != "proven":
                # Every rank is out of the stuck sync point and moving: the job recovered.
                self._armed = True
                if self.hangs:
                    self.hangs[-1]["recovered"] = True
                    self._save_hang(self.hangs[-1])
            self._notes.update(verdict, now, threshold, self.report)
            if not detect or not self._armed or failing:
                return None
            started = any(int(s.get("step", -1)) >= 1 for s in statuses.values())
            if not self._is_hang(verdict, threshold, longest, quiet, started):
                return None
            self._armed = False
        return self._on_hang(statuses, threshold, max(longest, quiet if started else 0.0), now, verdict)

    def _judge(
        self, statuses: dict[int, dict[str, Any]], alive: dict[int, bool], now: float, quiet: float
    ) -> Verdict:
        """The proof over this look, measuring the ranks' CPU and stacks only while it matters."""
        live = {r for r, a in alive.items() if a and not statuses[r].get("exited")}
        waiting = any(
            (statuses[r].get("phase") or {}).get("name") in SYNC and phase_since(statuses[r], now) >= 1.0
            for r in live
        )
        if not waiting and quiet < 1.0:
            self._tracker.forget()
            return judge(
                statuses, {r: Activity(alive=alive[r]) for r in statuses}, now, self._world(statuses)
            )
        measure = {r for r in live if (statuses[r].get("phase") or {}).get("name") not in ATOMIC}
        activity = self._tracker.look(
            statuses, now, measure, alive, want_frame=measure if waiting else None, since=self._rank_change
        )
        return judge(statuses, activity, now, self._world(statuses))

    @staticmethod
    def _world(statuses: dict[int, dict[str, Any]]) -> int | None:
        return max((int(s.get("world_size") or 0) for s in statuses.values()), default=0) or None

    def _is_hang(
        self, verdict: Verdict, threshold: float, longest: float, quiet: float, started: bool
    ) -> bool:
        """Proven: now. Stalled or blocked: past the threshold. Busy: only past --hang-timeout."""
        state = verdict.state
        if state == "proven":
            return True
        if state in ("stalled", "quiet"):
            return verdict.idle_s >= threshold
        if state == "busy":
            return self.hang_timeout is not None and verdict.wait_s >= self.hang_timeout
        if state == "blocked":
            return verdict.wait_s >= threshold
        if state == "unmeasured":  # no /proc, no stack: the wait alone decides, as it always did
            return longest > threshold or (started and quiet > threshold)
        return False

    def _on_hang(
        self,
        statuses: dict[int, dict[str, Any]],
        threshold: float,
        quiet: float,
        now: float,
        verdict: Verdict | None = None,
    ) -> dict[str, Any]:
        n = len(self.hangs) + 1
        hang_dir = RunDir(self.run_dir).hang(n)
        hang_dir.mkdir(exist_ok=True)
        stacks = _stacks.dump_all(statuses, self.use_pyspy)
        world = max((int(s.get("world_size") or 0) for s in statuses.values()), default=0) or None
        proof = ""
        if verdict is not None and verdict.state in ("proven", "busy"):
            proof = verdict.proof if verdict.state == "proven" else f"busy: {verdict.proof}"
        diag = analyse(
            statuses, stacks, threshold_s=threshold, quiet_s=quiet, now=now, world_size=world, proof=proof
        )
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
            "verdict": verdict.to_json() if verdict is not None else None,
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
            summary["killed_wall"] = time.time()  # where the report draws the kill
            self._save_hang(summary)
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
                "waits": self._notes.episodes,
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
