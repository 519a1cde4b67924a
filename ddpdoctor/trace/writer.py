"""Bounded, off-thread writer of one rank's trace file.

The training thread only appends a tuple to a deque (`put`); a daemon thread turns tuples into
JSON lines and flushes them every `flush_interval` seconds. When the deque is full, events are
dropped and counted rather than letting memory grow. Each accepted event is also copied into a
memory-mapped ring (trace/ring.py) that outlives a rank killed between two flushes. A failed
write (disk full, read-only directory) calls `on_error` once and turns the writer into a no-op:
the job goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ddpdoctor.trace import schema
from ddpdoctor.trace.ring import Ring, ring_path

_ENCODE = json.JSONEncoder(separators=(",", ":"), default=str).encode
_CHUNK = 128  # records encoded between GIL releases


class TraceWriter:
    """Owns one trace file. Event tuples are ``(kind, t0_ns, t1_ns, step, *fields)``."""

    def __init__(
        self,
        path: str,
        header: dict[str, Any],
        *,
        capacity: int = 100_000,
        flush_interval: float = 0.25,
        on_error: Callable[[BaseException], None] | None = None,
        ring: bool = False,
    ) -> None:
        self.path = path
        self.mono_anchor_ns: int = header["mono_ns"]
        self.dropped = 0
        self._reported_dropped = 0
        self._capacity = capacity
        self._queue: deque[tuple] = deque()
        self._on_error = on_error
        self._failed = False
        self._closed = False
        self._lock = threading.Lock()  # serialises drains (writer thread vs close)
        self._stop = threading.Event()
        self.on_tick: Callable[[], None] | None = None  # called after each periodic flush
        # kind -> callback that sees each such event as it is written (on this thread, never
        # the training thread): liveness keeps its recent-step summary this way.
        self.taps: dict[str, Callable[[tuple], None]] = {}
        self._ring: Ring | None = None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self._write([_ENCODE([schema.HEADER, header]) + "\n"])
        self.ring_error: BaseException | None = None  # why there is no ring, if asked for one
        if ring and not self._failed:
            try:
                self._ring = Ring(ring_path(path), self.mono_anchor_ns)
            except Exception as exc:  # no room or no mmap: the JSON trace alone, as before
                self.ring_error = exc
        self._thread = threading.Thread(
            target=self._run, args=(flush_interval,), name="ddpdoctor-writer", daemon=True
        )
        self._thread.start()

    def put(self, event: tuple) -> None:
        """Hot path: queue one event. Never blocks, never raises."""
        if len(self._queue) < self._capacity:
            self._queue.append(event)
            ring = self._ring
            if ring is not None:
                try:
                    ring.put(event)
                except Exception:
                    self._drop_ring(unlink=False)
        else:
            self.dropped += 1

    def meta(self, kind: str, step: int, info: dict[str, Any]) -> None:
        """Queue a metadata record stamped now."""
        now = time.monotonic_ns()
        self.put((kind, now, now, step, info))

    def flush(self) -> None:
        """Write everything queued so far (any thread)."""
        with self._lock:
            self._drain()

    def close(self, reason: str = "exit") -> None:
        """Flush, write the end record and close. Safe to call more than once."""
        if self._closed:
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
        with self._lock:
            if self._closed:
                return
            self._drain()
            if not self._failed:  # written directly: a full queue must not swallow the end
                now_us = (time.monotonic_ns() - self.mono_anchor_ns) // 1000
                self._write([_ENCODE([schema.END, now_us, 0, -1, {"reason": reason}]), "\n"])
            self._closed = True
            with contextlib.suppress(OSError):
                self._file.close()
            self._drop_ring(unlink=not self._failed)

    def _drop_ring(self, unlink: bool) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close(unlink)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._lock:
                if self._closed:
                    return
                self._drain()
            tick = self.on_tick
            if tick is not None:
                tick()

    def _drain(self) -> None:
        if self._failed or self._closed:
            self._queue.clear()
            return
        anchor = self.mono_anchor_ns
        lines: list[str] = []
        pop = self._queue.popleft
        taps = self.taps
        try:
            while True:
                event = pop()
                kind, t0, t1, step, *fields = event
                if kind in taps:
                    _tap(taps[kind], event)
                lines.append(_ENCODE([kind, (t0 - anchor) // 1000, (t1 - t0) // 1000, step, *fields]))
                if len(lines) % _CHUNK == 0:
                    time.sleep(0)  # let the training thread have the GIL between chunks
        except IndexError:
            pass
        if self.dropped != self._reported_dropped:
            count, self._reported_dropped = self.dropped, self.dropped
            now_us = (time.monotonic_ns() - anchor) // 1000
            lines.append(_ENCODE([schema.DROPPED, now_us, 0, -1, {"count": count}]))
        if lines:
            self._write(["\n".join(lines), "\n"])

    def _write(self, parts: list[str]) -> None:
        try:
            self._file.writelines(parts)
            self._file.flush()
        except (OSError, ValueError) as exc:
            self._failed = True
            self._queue.clear()
            self._drop_ring(unlink=True)  # the trace stops here: nothing to complete it with
            if self._on_error is not None:
                self._on_error(exc)


def _tap(tap: Callable[[tuple], None], event: tuple) -> None:
    """A tap that fails must not cost the trace."""
    with contextlib.suppress(Exception):
        tap(event)
