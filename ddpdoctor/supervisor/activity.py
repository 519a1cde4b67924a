"""Is a rank progressing? Its CPU time and its Python stack, measured from outside.

A rank that evaluates, writes a checkpoint or logs is not hung even when the others wait for
it minutes; a rank stuck on a lock, a dead socket or ``sleep`` in a retry loop is. The rank's
own status cannot say which (its writer thread may not get the GIL), so the supervisor looks:

* CPU time: ``utime + stime`` of the rank's main thread (``/proc/<pid>/task/<pid>/stat``, the
  thread that trains, as the stack below), compared over a window of ``WINDOW_S``; at least
  ``MIN_RATE`` of one core means work. The process as a whole is not the measure: on a loaded
  host the doctor's writer thread (status files four times a second), gloo's and the loader's
  threads add a few ticks a second to a rank whose training thread is stuck on a lock, enough
  to make it look busy.
* Stack: when the CPU is idle, a non-blocking ``py-spy dump`` every ``STACK_EVERY_S`` (never
  pausing the rank, never sending it a signal); a different main-thread stack means progress
  (a sleeping retry loop that sleeps in the same line is not). The dump runs on its own thread
  and is read at a later look: on a loaded host one takes seconds, and a watcher that waited
  for it would judge the job on statuses that old.

Tracking costs one small read per rank and window, and only runs while the watcher asks
(someone waits, or nothing has been recorded for a while); stack samples are limited to
ranks outside every sync point and to ``DUMPS_PER_S`` for the whole job.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpdoctor.analysis.hung.hang import main_thread, user_frame
from ddpdoctor.analysis.hung.proof import COMPOUND, Activity
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.supervisor import stacks as _stacks
from ddpdoctor.trace.stacktext import runs_own_code

WINDOW_S = 1.0
MIN_RATE = 0.05  # CPU seconds per second
STACK_EVERY_S = 2.0  # per rank
DUMPS_PER_S = 1.0  # all ranks together: a dump costs the supervisor ~0.1 s of CPU
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) the process's main thread has used so far (None: unreadable)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of proc(5)
    except (OSError, IndexError, ValueError):
        return None


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


def zombie_signal(pid: int) -> int | None:
    """The signal that killed ``pid`` if it is still a zombie (Linux /proc/PID/stat exit_code)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[-1].split()
        code = int(fields[-1])  # field 52: the status waitpid would report
    except (OSError, ValueError, IndexError):
        return None
    return code & 0x7F or None


def describe_frame(dump: dict[str, Any]) -> tuple[tuple[Any, ...], str | None, bool]:
    """(signature of the main thread's stack, 'evaluate() train.py:27' or None, whether it runs
    the user's own code inside a DDP pass)."""
    frames = main_thread(dump.get("threads") or [])
    sig = tuple((f.get("file"), f.get("line"), f.get("function")) for f in frames)
    user = user_frame(frames)
    if user is None:
        return sig, None, False
    where = f"{user.get('function')}() {os.path.basename(str(user.get('file')))}:{user.get('line')}"
    return sig, where, runs_own_code(frames)


@dataclass
class _Sample:
    """One stack sample under way: asked for at ``t``, ``dump`` once ``done`` is set."""

    t: float
    done: threading.Event
    dump: dict[str, Any] | None = None


@dataclass
class _Track:
    pid: int
    ref_t: float
    ref_cpu: float | None
    moved_t: float
    known: bool = False  # one full window measured
    rate: float | None = None
    stack_t: float = 0.0
    stack_sig: tuple[Any, ...] = ()
    frame: str | None = None
    own_code: bool = False  # the last stack: the user's own code inside a DDP pass
    sample: _Sample | None = None


def _in_thread(work: Callable[[], None]) -> None:
    threading.Thread(target=work, name="ddpdoctor-stack-sample", daemon=True).start()


class ActivityTracker:
    """Per-rank progress facts for ``proof.judge``; state lives here, judgement does not.
    ``spawn`` runs a stack sample (a daemon thread; a test may run it inline)."""

    def __init__(
        self,
        dump: Callable[[int], dict[str, Any]] | None = None,
        cpu: Callable[[int], float | None] = proc_cpu_s,
        spawn: Callable[[Callable[[], None]], None] = _in_thread,
    ) -> None:
        self._dump = dump
        self._cpu = cpu
        self._spawn = spawn
        self._tracks: dict[int, _Track] = {}
        self._next_dump = 0.0
        self._sampling: _Sample | None = None  # one sample at a time for the whole job

    def forget(self) -> None:
        """Stop tracking (nobody waits): the next episode measures afresh."""
        self._tracks.clear()

    def look(
        self,
        statuses: dict[int, RankStatus],
        now: float,
        ranks: set[int],
        alive: dict[int, bool],
        want_frame: set[int] | None = None,
        since: dict[int, float] | None = None,
    ) -> dict[int, Activity]:
        """Measure ``ranks`` now; every rank gets an Activity (unmeasured ones: idle unknown).
        ``since``: when each rank last recorded an event, the latest progress known before the
        first measurement."""
        out: dict[int, Activity] = {}
        # Stacks of ranks inside a DDP pass only when no rank is elsewhere: that one is the
        # question then, and dumps are few (DUMPS_PER_S).
        any_outside = any(not st.in_sync for r, st in statuses.items() if r in ranks)
        for rank, st in statuses.items():
            pid = st.pid or 0
            if rank not in ranks or not alive.get(rank, True) or pid <= 0:
                out[rank] = Activity(alive=alive.get(rank, True))
                continue
            tr = self._tracks.get(rank)
            if tr is not None and tr.pid == pid and now - tr.ref_t < WINDOW_S:
                self._read_sample(tr)  # mid-window: only a stack sample may have come back
                out[rank] = self._activity(tr, now)
                continue
            cpu = self._cpu(pid)
            if cpu is None and st.cpu_s is not None:
                cpu = float(st.cpu_s)
            if tr is None or tr.pid != pid:
                start = min(now, (since or {}).get(rank, now))
                tr = self._tracks[rank] = _Track(pid, now, cpu, start)
            elif now - tr.ref_t >= WINDOW_S:
                if cpu is not None and tr.ref_cpu is not None:
                    tr.rate = (cpu - tr.ref_cpu) / (now - tr.ref_t)
                    if tr.rate >= MIN_RATE:
                        tr.moved_t = now
                tr.known = True
                tr.ref_t, tr.ref_cpu = now, cpu
            self._read_sample(tr)
            idle_cpu = tr.rate is None or tr.rate < MIN_RATE
            # A rank in a DDP pass with its CPU idle waits for its peers or is blocked in its own
            # code there (a hook, an autograd Function): its stack tells which.
            compound = (st.phase or {}).get("name") in COMPOUND and not any_outside
            outside = not st.in_sync
            needs_frame = want_frame is not None and rank in want_frame and tr.frame is None
            if (
                self._dump is not None
                and (outside or compound)
                and (idle_cpu or (outside and needs_frame))
                and now - tr.stack_t >= STACK_EVERY_S
                and now >= self._next_dump
                and (self._sampling is None or self._sampling.done.is_set())
            ):
                self._next_dump = now + 1.0 / DUMPS_PER_S
                tr.stack_t = now
                tr.sample = self._sampling = self._sample(pid, now)
                self._read_sample(tr)  # a sample run inline is read at once
            out[rank] = self._activity(tr, now)
        return out

    def _sample(self, pid: int, now: float) -> _Sample:
        sample = _Sample(now, threading.Event())
        dump = self._dump
        assert dump is not None

        def work() -> None:
            try:
                sample.dump = dump(pid)
            finally:
                sample.done.set()

        self._spawn(work)
        return sample

    @staticmethod
    def _read_sample(tr: _Track) -> None:
        """A finished sample: a new stack since the last one means the rank moved, by the time
        the sample was asked for at the latest."""
        sample = tr.sample
        if sample is None or not sample.done.is_set():
            return
        tr.sample = None
        dump = sample.dump or {}
        if dump.get("threads"):
            sig, frame, own = describe_frame(dump)
            if tr.stack_sig and sig != tr.stack_sig:
                tr.moved_t = max(tr.moved_t, sample.t)
            tr.stack_sig, tr.frame, tr.own_code = sig, frame or tr.frame, own

    @staticmethod
    def _activity(tr: _Track, now: float) -> Activity:
        idle = (now - tr.moved_t) if tr.known else None
        return Activity(True, idle, tr.rate, tr.frame, not tr.known, tr.own_code)


def pyspy_sample(pid: int) -> dict[str, Any]:
    """A non-blocking py-spy dump (the rank is never paused); empty when py-spy cannot."""
    return _stacks.pyspy_dump(pid, timeout=3.0, nonblocking=True)
