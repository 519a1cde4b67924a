"""Device spans: CUDA events around DDP's phases, resolved off the training thread.

On a GPU the CPU only launches work, so a CPU timestamp around ``forward`` or a future's
callback measures launches, not the device. The training thread here only takes an event
from a pool and records it on the current stream (no ``synchronize()``, no query); a daemon
thread polls ``event.query()`` and, once both ends of a span have completed on the device,
turns them into times on the rank's monotonic clock and queues the span into the trace.

Device time to monotonic time: every event is recorded right after a CPU timestamp, and the
device cannot run an event before it is recorded, so ``cpu_ns - device_ns`` of each event is
a lower bound of the clock offset; it is exact for an event recorded on an idle stream. The
resolver also records such anchor events itself whenever a stream it has seen is idle. The
offset used is the largest bound over a sliding window (clocks drift by parts per million),
and spans are converted in batches with one offset, so differences inside a batch are exact
device differences.

Memory is bounded: at most ``MAX_EVENTS`` events exist (pooled, recycled after resolution)
and at most ``MAX_PENDING`` spans wait; beyond that spans are counted as dropped.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ddpdoctor.probes import guard
from ddpdoctor.trace import schema

PROBE = "cuda_timing"
_now = time.monotonic_ns
MAX_EVENTS = 4096
MAX_PENDING = 1024
POLL_S = 0.005
WINDOW_NS = 30 * 10**9  # offset bounds older than this are forgotten (clock drift)

ACTIVE: DeviceTimer | None = None  # set while a CUDA DDP model is being timed in this rank
# CUDA graph captures in progress (any thread). While one runs nothing is recorded or queried:
# an event recorded into a capture would join the graph, and in the default "global" capture
# mode a query from another thread invalidates the user's capture.
CAPTURING = 0


def _handle(stream: Any) -> tuple[int, int]:
    """The CUDA stream behind a ``torch.cuda.Stream``: ``current_stream()`` returns a new
    Python object at each call, so its ``id`` would name one stream many times (and the
    default stream's ``cuda_stream`` is 0 on every device)."""
    sid = getattr(stream, "stream_id", None)
    return (int(getattr(stream, "device_index", 0) or 0), int(sid)) if sid is not None else (-1, id(stream))


class _Span:
    __slots__ = ("kind", "start", "end", "t_start", "t_end", "step", "fields")

    def __init__(self, kind: str, start: Any, t_start: int, step: int, fields: tuple) -> None:
        self.kind, self.start, self.t_start, self.step, self.fields = kind, start, t_start, step, fields
        self.end: Any = None
        self.t_end = 0


class DeviceTimer:
    """Pooled CUDA events for one rank; ``cuda`` is ``torch.cuda`` (or a test's stand-in)."""

    def __init__(
        self,
        put: Any,
        device: Any,
        cuda: Any,
        *,
        poll_s: float = POLL_S,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.put = put  # the trace writer's put: (kind, t0_ns, t1_ns, step, *fields)
        self.device = device
        self.cuda = cuda
        self.free: list[Any] = []
        self.created = 0
        self.dropped = 0
        self.pending: deque[_Span] = deque()
        self.anchors: deque[tuple[Any, int]] = deque()  # (event, cpu ns just before its record)
        self.streams: dict[tuple[int, int], Any] = {}  # handle -> stream: where the resolver takes anchors
        # (cpu ns, cpu ns - device ns), the bounds falling left to right: the offset (the largest
        # in the window) is the first; a bound below a later one can never be it, and is dropped.
        self.bounds: deque[tuple[int, float]] = deque()
        self.failed: BaseException | None = None
        self.on_error = on_error
        self.optimizer_span: _Span | None = None  # between the optimizer's pre and post hooks
        # Device times are measured from this event (its own, never recycled).
        stream = cuda.current_stream(device)
        self.streams[_handle(stream)] = stream
        self.ref = cuda.Event(enable_timing=True)
        self.ref_cpu = _now()
        self.ref.record(stream)
        self.ref_done = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(poll_s,), name="ddpdoctor-cuda", daemon=True)
        self._thread.start()

    # -- training thread (and the autograd / callback threads): take, record, queue ----------

    def begin(self, kind: str, step: int, fields: tuple = ()) -> _Span | None:
        """Record a span's start on the current stream; None when the pool is exhausted."""
        try:
            return self._begin(kind, step, fields)
        except Exception as exc:
            self._fail(exc)
            return None

    def finish(self, span: _Span | None) -> None:
        """Record the span's end on the current stream and hand it to the resolver."""
        if span is None:
            return
        try:
            self._finish(span)
        except Exception as exc:
            self._fail(exc)

    def _begin(self, kind: str, step: int, fields: tuple) -> _Span | None:
        if CAPTURING:
            return None
        ev = self._take()
        if ev is None:
            return None
        stream = self.cuda.current_stream(self.device)
        t = _now()
        ev.record(stream)
        key = _handle(stream)
        if key not in self.streams:
            self.streams[key] = stream
        return _Span(kind, ev, t, step, fields)

    def _finish(self, span: _Span) -> None:
        if CAPTURING:  # the start is outside the capture: give its event back unread later
            self.dropped += 1
            self.pending.append(_Span("", span.start, span.t_start, -1, ()))
            self.pending[-1].end, self.pending[-1].t_end = span.start, span.t_start
            return
        ev = self._take()
        if ev is None or len(self.pending) >= MAX_PENDING:
            self.dropped += 1
            self._recycle(span.start)
            if ev is not None:
                self._recycle(ev)
            return
        t = _now()
        ev.record(self.cuda.current_stream(self.device))
        span.end, span.t_end = ev, t
        self.pending.append(span)

    def _take(self) -> Any:
        try:
            return self.free.pop()
        except IndexError:
            pass
        if self.created >= MAX_EVENTS:
            self.dropped += 1
            return None
        self.created += 1
        return self.cuda.Event(enable_timing=True)

    def _recycle(self, ev: Any) -> None:
        self.free.append(ev)

    # -- resolver thread ---------------------------------------------------------------

    def _run(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                self.poll()
            except Exception as exc:  # a device error: stop timing, the job goes on
                self._fail(exc)
                return

    def poll(self) -> int:
        """Anchor on idle streams, resolve completed spans and emit them; returns spans emitted."""
        if CAPTURING:
            return 0
        if not self.ref_done:
            if not self.ref.query():
                return 0
            self.ref_done = True
            self._bound(self.ref_cpu, 0.0)
        self._anchor()
        while self.anchors and self.anchors[0][0].query():
            ev, t = self.anchors.popleft()
            self._bound(t, self.ref.elapsed_time(ev) * 1e6)
            self._recycle(ev)
        done: list[tuple[_Span, float, float]] = []
        while self.pending:
            span = self.pending[0]
            if not (span.end.query() and span.start.query()):
                break  # spans complete about in order: wait for the head
            self.pending.popleft()
            if not span.kind:  # a span cut by a graph capture: only its event comes back
                self._recycle(span.start)
                continue
            s = self.ref.elapsed_time(span.start) * 1e6  # ms -> ns on the device clock
            e = self.ref.elapsed_time(span.end) * 1e6
            self._bound(span.t_start, s)
            self._bound(span.t_end, e)
            self._recycle(span.start)
            self._recycle(span.end)
            done.append((span, s, e))
        if not done:
            return 0
        offset = self.offset()
        for span, s, e in done:
            t0 = int(s + offset)
            self.put((span.kind, t0, max(t0, int(e + offset)), span.step, *span.fields))
        return len(done)

    def offset(self) -> float:
        """Add to a device time (ns since ``ref``) to get this rank's monotonic ns."""
        return self.bounds[0][1] if self.bounds else float(self.ref_cpu)

    def _anchor(self) -> None:
        """On each idle stream, record an event now: it completes (almost) at once, so its
        CPU time is a tight bound. A stream that turned busy in between only loosens it."""
        if self.anchors:
            return  # one outstanding at a time
        for stream in list(self.streams.values()):
            if not stream.query():
                continue
            ev = self._take()
            if ev is None:
                return
            t = _now()
            ev.record(stream)
            self.anchors.append((ev, t))

    def _bound(self, t_cpu: int, device_ns: float) -> None:
        """Add a bound (amortised O(1): the resolver adds two per span and one per anchor, and
        a scan of 30 s of them per poll held the GIL against the training thread)."""
        bounds, bound = self.bounds, t_cpu - device_ns
        t = max(t_cpu, bounds[-1][0]) if bounds else t_cpu  # spans resolve about in order
        while bounds and bounds[-1][1] <= bound:
            bounds.pop()
        bounds.append((t, bound))
        while bounds[0][0] < t - WINDOW_NS:
            bounds.popleft()

    def stop(self, flush: bool = True, wait_s: float = 2.0) -> None:
        """Stop the resolver; with ``flush``, emit the spans the device completes within
        ``wait_s`` (at exit, after the job's own code: the device is finishing its queue)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=1.0)
        deadline = _now() + int(wait_s * 1e9)
        while flush and self.failed is None:
            try:
                self.poll()
            except Exception as exc:
                self._fail(exc)
            if not self.pending or _now() > deadline:
                break
            time.sleep(0.002)

    def _fail(self, exc: BaseException) -> None:
        """Log once (through ``on_error``) and switch device timing off for this rank; what a
        signal handler raised is the program's and goes on up (guard.py)."""
        global ACTIVE
        guard.passthrough(exc)
        if self.failed is not None:
            return
        self.failed = exc
        self._stop.set()
        if ACTIVE is self:
            ACTIVE = None
        if self.on_error is not None:
            self.on_error(exc)


def device_of(module: Any) -> Any:
    """The CUDA device a DDP model's parameters live on, or None (CPU: nothing is timed)."""
    for p in module.parameters():
        return p.device if p.device.type == "cuda" else None
    return None


def _cuda() -> Any:
    import torch

    return torch.cuda


def start(collector: Any, module: Any) -> DeviceTimer | None:
    """Start timing on the device when ``module`` is on CUDA (once per rank). Never raises."""
    global ACTIVE
    if ACTIVE is not None:
        return ACTIVE
    try:
        device = device_of(module)
        if device is None:
            return None
        timer = DeviceTimer(collector.put, device, _cuda(), on_error=lambda e: collector.fail(PROBE, e))
    except Exception as exc:
        collector.fail(PROBE, exc)
        return None
    ACTIVE = timer
    _watch_captures()
    atexit.register(timer.stop)  # runs before the collector's close (registered earlier)
    os.register_at_fork(after_in_child=_forget_in_child)
    return timer


def _watch_captures() -> None:
    """Count CUDA graph captures (``torch.cuda.CUDAGraph.capture_begin``/``capture_end``)."""
    from torch.cuda.graphs import CUDAGraph

    from ddpdoctor.probes.patching import patch

    patch(CUDAGraph, "capture_begin", counting_begin)
    patch(CUDAGraph, "capture_end", counting_end)


def counting_begin(capture_begin: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        global CAPTURING
        CAPTURING += 1
        try:
            return capture_begin(self, *args, **kwargs)
        except BaseException:
            CAPTURING -= 1
            raise

    return wrapped


def counting_end(capture_end: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        global CAPTURING
        try:
            return capture_end(self, *args, **kwargs)
        finally:
            CAPTURING = max(0, CAPTURING - 1)

    return wrapped


def _forget_in_child() -> None:
    global ACTIVE
    ACTIVE = None


DEV_FORWARD = schema.DEV_FORWARD
DEV_BACKWARD = schema.DEV_BACKWARD
DEV_OPTIMIZER = schema.DEV_OPTIMIZER
DEV_ALLREDUCE = schema.DEV_ALLREDUCE
