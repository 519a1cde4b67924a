"""What lets the supervisor watch a live rank: a status file, stack dumps on request, errors.

* ``status-rank{R}.json``: rewritten atomically by the trace writer's thread after every flush
  (that thread keeps running while the training thread is blocked in gloo/NCCL), so the
  supervisor reads the rank's current sync point and a heartbeat without touching the process.
* ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``: under Yama ``ptrace_scope=1`` only ancestors
  may attach; the supervisor's py-spy is a sibling, so the rank opts in to being traced.
* ``faulthandler`` on SIGUSR1 into ``stacks-rank{R}.txt``: a stack dump that needs no ptrace.
  Registered only when SIGUSR1 is unclaimed, and advertised in the status file, because the
  default action of SIGUSR1 would kill the rank.
* ``sys.excepthook``/``threading.excepthook``: the exception that kills a rank is recorded as a
  ``rank_error`` record and flushed at once, whether or not the script uses torchrun's
  ``@record``; the user's hook (or Python's) still runs afterwards.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from ddpdoctor.probes import flight_recorder, guard
from ddpdoctor.probes.recent import RecentFingerprints, RecentSteps
from ddpdoctor.probes.status import RankStatus, StatusFile
from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import schema

if TYPE_CHECKING:  # the collector imports this module, never the other way at run time
    from ddpdoctor.probes.collector import Collector

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1)


class _Liveness:
    def __init__(self, collector: Collector) -> None:
        self.c = collector
        path = RunDir(collector.run_dir).status(collector.rank)
        self.file = StatusFile(path)
        self.pid = os.getpid()
        try:
            self.world_size: int | None = int(collector.default_pg.size())
        except Exception as exc:
            guard.passthrough(exc)
            self.world_size = None
        self.ptracer = _allow_ptrace()
        self.stacks_file = _register_faulthandler(collector)
        self.error: dict[str, Any] | None = None
        self.broken = False
        self.host = socket.gethostname()
        local_rank = os.environ.get("LOCAL_RANK", "")
        self.local_rank = int(local_rank) if local_rank.isdigit() else None
        node = os.environ.get("GROUP_RANK", "")  # torchrun's node rank: which node's watcher reads us
        self.node = int(node) if node.isdigit() else None
        self.recent = RecentSteps()
        self.fingerprints = RecentFingerprints(steps=self.recent)
        self.seen_events = -1
        self.progress_wall = time.time()  # when the event count last moved
        self.exited = False
        self._lock = threading.Lock()  # the writer thread and the exit hook both publish
        self.last_seq = -1  # after destroy_process_group the group answers no more: keep the last
        self._group_ranks: dict[int, list[int] | None] = {}

    def status(self) -> RankStatus:
        c = self.c
        if self.stacks_file and signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            self.stacks_file = None  # the job took SIGUSR1 since: never send it ours
        progress = c.progress
        now = time.monotonic_ns()
        phase = None
        if progress is not None:
            name, op, seq, t0 = progress[:4]
            phase = {"name": name, "op": op, "seq": seq, "since_s": round((now - t0) / 1e9, 3)}
            if len(progress) >= 8:
                phase.update(group=progress[4], group_size=progress[5], bytes=progress[6])
                phase["group_ranks"] = self.group_ranks(progress[7], progress[4])
                if len(progress) >= 9:  # the rest of the signature (probes/collectives.py)
                    dtype, numel, root, ranks = progress[8]
                    phase.update(dtype=dtype, numel=numel, root=root, ranks=ranks)
            elif name == "backward":  # its sequence number is the default group's
                phase.update(group="WORLD", group_size=self.world_size)
        cpu_s = time.process_time()  # the supervisor reads /proc; this serves where it cannot
        wall = time.time()
        if c.events != self.seen_events:
            self.seen_events, self.progress_wall = c.events, wall
        return RankStatus(
            rank=c.rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            node=self.node,
            host=self.host,
            pid=self.pid,
            heartbeat_wall=wall,
            progress_wall=self.progress_wall,
            exited=self.exited,
            step=c.step,
            events=c.events,
            seq=self.seq(),
            phase=phase,
            max_step_s=round(c.max_step_ns / 1e9, 3),
            faulthandler=self.stacks_file,
            ptracer=self.ptracer,
            error=self.error,
            cpu_s=round(cpu_s, 3),
            **self.recent.status(now),
            **self.fingerprints.status(),
        )

    def seq(self) -> int:
        seq = self.c.progress_seq()
        if seq >= 0:
            self.last_seq = seq
        return self.last_seq

    def group_ranks(self, pg: Any, name: str) -> list[int] | None:
        """Global ranks of a subgroup (None for WORLD: every rank), looked up once per group."""
        if name == "WORLD" or pg is None:
            return None
        key = id(pg)
        if key not in self._group_ranks:
            try:
                import torch.distributed as dist

                self._group_ranks[key] = [int(r) for r in dist.get_process_group_ranks(pg)]
            except Exception as exc:
                guard.passthrough(exc)
                self._group_ranks[key] = None
        return self._group_ranks[key]

    def publish(self) -> None:
        """Runs on the writer thread after every flush; never raises."""
        if self.broken or self.pid != os.getpid():
            return
        try:
            with self._lock:
                self.file.write(self.status())
        except Exception as exc:
            self.broken = True
            self.c.fail("status", exc)


def guarded_taps(c: Any, taps: dict[str, Any]) -> dict[str, Any]:
    """Taps that, on their first failure, log it once (probe "recent") and all switch off."""

    def guard(fn: Any) -> Any:
        def tap(event: tuple) -> None:
            try:
                fn(event)
            except Exception as exc:
                for kind in taps:
                    c.writer.taps.pop(kind, None)
                c.fail("recent", exc)

        return tap

    return {kind: guard(fn) for kind, fn in taps.items()}


def _last_publish(live: _Liveness) -> None:
    """The rank is exiting normally: publish its final step count and say it ended."""
    if not live.c.live:
        return
    with contextlib.suppress(Exception):
        if live.c.native:  # the C++ timer's last buckets: the taps see them in this flush
            from ddpdoctor.probes.commhook import drain

            drain(live.c)
        live.c.writer.flush()
    live.recent.finish()
    live.exited = True
    live.publish()


def _allow_ptrace() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) == 0
    except Exception:
        return False


_stacks_fh: Any = None  # kept open for faulthandler's C handler


def _register_faulthandler(c: Collector) -> str | None:
    global _stacks_fh
    sigusr1 = getattr(signal, "SIGUSR1", None)
    if sigusr1 is None or threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(sigusr1) not in (signal.SIG_DFL, None):
        return None  # the job uses SIGUSR1 itself: never steal it
    path = str(RunDir(c.run_dir).stacks(c.rank))
    try:
        _stacks_fh = open(path, "a", encoding="utf-8")  # noqa: SIM115  (lives as long as the rank)
        faulthandler.register(sigusr1, file=_stacks_fh, all_threads=True, chain=False)
    except Exception:
        return None
    return path


def _format_error(exc_type: Any, exc: Any, tb: Any, thread: str) -> dict[str, Any]:
    """The rank's error record, built without reading a source file: when a peer dies the
    launcher stops the survivors within milliseconds (torchrun's SIGTERM), and looking up a
    traceback's source lines (linecache reading cold files) took longer than that, so the record
    of what the survivor was doing was lost. The traceback text names file, line and function
    of the exception and of its chained causes (what the analysis reads: a DataLoader worker
    "killed by signal" is the cause of "exited unexpectedly"); Python's own, with the source
    lines, is in the rank's stderr."""
    frames = [[f.f_code.co_filename, lineno, f.f_code.co_name] for f, lineno in traceback.walk_tb(tb)]
    record = {
        "type": getattr(exc_type, "__name__", str(exc_type)),
        "message": str(exc)[:2000],
        "traceback": _chain_text(exc_type, exc, tb)[-20000:],
        "frames": frames[-50:],
        "thread": thread,
        "wall_ns": time.time_ns(),
    }
    handler = guard.handler_frame(tb)  # raised by a signal handler: where the signal came in
    if handler is not None and handler - max(0, len(frames) - 50) > 0:
        record["signal_handler"] = handler - max(0, len(frames) - 50)
    return record


_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def _chain_text(exc_type: Any, exc: Any, tb: Any) -> str:
    """Python's traceback text of ``exc`` and its causes, oldest first, with no source lines."""
    parts: list[str] = []
    seen: set[int] = set()
    while True:
        seen.add(id(exc))
        stack = [(f.f_code.co_filename, line, f.f_code.co_name, "") for f, line in traceback.walk_tb(tb)]
        only = traceback.TracebackException(exc_type, exc, None, lookup_lines=False, compact=True)
        head = "Traceback (most recent call last):\n" if stack else ""
        parts.append(head + "".join(traceback.StackSummary.from_list(stack).format()))
        parts[-1] += "".join(only.format_exception_only())
        cause = getattr(exc, "__cause__", None)
        context = None if getattr(exc, "__suppress_context__", False) else getattr(exc, "__context__", None)
        nxt, sep = (cause, _CAUSE) if cause is not None else (context, _CONTEXT)
        if nxt is None or id(nxt) in seen or len(seen) > 16:
            return "".join(reversed(parts))
        parts.append(sep)
        exc_type, exc, tb = type(nxt), nxt, nxt.__traceback__


def _record_error(live: _Liveness, info: dict[str, Any]) -> None:
    c = live.c
    c.meta(schema.RANK_ERROR, info)
    c.writer.flush()
    if info["thread"] == "MainThread" and live.error is None:
        live.error = {k: info[k] for k in ("type", "message", "wall_ns")}
    live.publish()


def install(c: Collector) -> None:
    live = _Liveness(c)
    c.writer.taps.update(guarded_taps(c, {**live.recent.taps(), **live.fingerprints.taps()}))
    c.writer.tap_tail.update(live.recent.NEWEST)
    from ddpdoctor.probes.commhook import drain

    def tick() -> None:  # after each flush, on the writer thread
        if c.native:  # the C++ timer's buckets: in the trace within a flush, a hang's too
            drain(c)
        live.publish()

    c.writer.on_tick = tick
    live.publish()
    atexit.register(_last_publish, live)  # runs before the collector's close (atexit is LIFO)
    previous = sys.excepthook

    def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if c.live and not issubclass(exc_type, KeyboardInterrupt):
                _record_error(live, _format_error(exc_type, exc, tb, "MainThread"))
        except Exception:
            pass
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    previous_thread_hook = threading.excepthook

    def thread_excepthook(args: Any) -> None:
        try:
            if c.live and args.exc_type is not SystemExit:
                name = getattr(args.thread, "name", "?")
                _record_error(live, _format_error(args.exc_type, args.exc_value, args.exc_traceback, name))
        except Exception:
            pass
        previous_thread_hook(args)

    threading.excepthook = thread_excepthook
    flight_recorder.install(c)  # dumps the collectives' state when the supervisor asks
