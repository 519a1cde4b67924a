"""A stand-in for ``torch.cuda`` at the Event/stream boundary that keeps CUDA's asynchrony.

The device clock is the host's monotonic clock (so a test knows the truth), but work runs
later than it is launched: each stream has a ``busy_until``; ``launch(ns)`` queues a kernel
behind it, and an event recorded on a stream completes when the stream reaches it, not when
``record`` returns. ``query()`` answers from the clock; ``elapsed_time`` raises, as CUDA does,
when either event has not completed. ``synchronize`` is counted, so tests can assert that
the training thread never blocked on the device.
"""

from __future__ import annotations

import threading
import time
from typing import Any

_now = time.monotonic_ns


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_until = 0
        self.lock = threading.Lock()

    def launch(self, ns: int, after: int = 0) -> int:
        """Queue ``ns`` of device work (starting no earlier than ``after``); its end time."""
        with self.lock:
            self.busy_until = max(_now(), self.busy_until, after) + ns
            return self.busy_until

    def wait_until(self, t: int) -> None:
        """Like ``wait_stream``/``wait_event``: later work here starts after ``t``."""
        with self.lock:
            self.busy_until = max(self.busy_until, t)

    def query(self) -> bool:
        return _now() >= self.busy_until


class StreamView:
    """What ``torch.cuda.current_stream()`` returns: a new Python object at every call, for the
    same stream (``stream_id`` and ``device_index`` are what stay the same; ``cuda_stream``,
    the raw handle, is 0 for every device's default stream)."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.stream_id, self.device_index = id(stream), 0
        self.cuda_stream = 0 if stream.name == "default" else id(stream)

    def __getattr__(self, name: str) -> Any:  # query, launch, wait_until: the stream's own
        return getattr(self.stream, name)


class FakeEvent:
    def __init__(self, cuda: FakeCuda, enable_timing: bool = False) -> None:
        self.cuda = cuda
        self.timing = enable_timing
        self.done_at: int | None = None
        cuda.events_created += 1

    def record(self, stream: FakeStream | StreamView | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        stream = stream.stream if isinstance(stream, StreamView) else stream
        with stream.lock:
            self.done_at = max(_now() + self.cuda.record_lag_ns, stream.busy_until)
            stream.busy_until = self.done_at
        self.cuda.records += 1

    def query(self) -> bool:
        return self.done_at is not None and _now() >= self.done_at

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.timing and end.timing, "device spans need timing events"
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready")
        assert self.done_at is not None and end.done_at is not None
        return (end.done_at - self.done_at) / 1e6

    def synchronize(self) -> None:
        self.cuda.synchronizes += 1


class FakeCuda:
    """``torch.cuda`` as the timer uses it: ``Event``, ``current_stream``, ``synchronize``."""

    def __init__(self, record_lag_ns: int = 0) -> None:
        self.record_lag_ns = record_lag_ns
        self.default = FakeStream("default")
        self.local = threading.local()
        self.events_created = 0
        self.records = 0
        self.synchronizes = 0

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802  (torch's name)
        return FakeEvent(self, enable_timing)

    def current_stream(self, device: Any = None) -> StreamView:
        return StreamView(getattr(self.local, "stream", None) or self.default)

    def set_stream(self, stream: FakeStream | None) -> None:
        self.local.stream = stream

    def synchronize(self, device: Any = None) -> None:
        self.synchronizes += 1
