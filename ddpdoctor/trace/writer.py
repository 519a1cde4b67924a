"""Bounded, off-thread trace writing: the training thread packs each event into a slot of the
recording ring (``trace/ring.py``); a writer thread appends the filled slots to the binary
trace (``trace/binfmt.py``) every fraction of a second, grouped by kind with numpy.

What the training thread pays per event: a dict lookup for its kind, one ``pack_into`` and,
for a string field, a dict lookup of its interned id. A value seen for the first time is
written to the trace at once (its ``STR_`` block), as is each metadata record (rare: sites,
buckets, loader passes, errors), so both are on disk before any event that refers to them.
The writer thread's work per flush is a few numpy calls per kind present and one ``write``.
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

import numpy as np

from ddpdoctor import _env
from ddpdoctor.trace import binfmt, schema
from ddpdoctor.trace.ring import (
    HEADER_BYTES,
    SLOT,
    VOID,
    VOID_SLOT,
    Part,
    Ring,
    Seqs,
    ring_path,
    sizes_of,
    slot_struct,
)

TAP_TAIL = 1024  # events of a tapped kind handed to its tap per flush: the newest
# (struct format, kind id) -> a C packer of that kind's events, or None: given by the probes
Packer = Callable[[str, int], Any]


class _Kind:
    """How one kind's events are packed: its id, its ``struct``, where its interned fields are."""

    __slots__ = ("kid", "pack_into", "n", "interned", "dtype", "spec", "defaults", "fast")

    def __init__(self, kid: int, spec: str, packer: Packer | None = None) -> None:
        self.kid, self.spec, self.n = kid, spec, len(spec)
        layout = slot_struct(spec)
        self.pack_into = layout.pack_into
        # the same packing in C (probes/_fast.c), where built: (ring, step, t0, t1, fields)
        self.fast = packer(layout.format, kid) if packer is not None else None
        self.interned = tuple(i for i, c in enumerate(spec) if c in schema.INTERNED)
        self.dtype = schema.record_dtype(spec)
        self.defaults = tuple("" if c in schema.INTERNED else 0 if c == "f" else -1 for c in spec)


class TraceWriter:
    """Owns one trace file. Event tuples are ``(kind, t0_ns, t1_ns, step, *fields)``."""

    def __init__(
        self,
        path: str,
        header: dict[str, Any],
        *,
        flush_interval: float = _env.FLUSH_INTERVAL_S,
        on_error: Callable[[BaseException], None] | None = None,
        ring: bool = False,
        capacity: int | None = None,
        packer: Packer | None = None,
        seqs: Callable[[Any, int], Any] = Seqs,
    ) -> None:
        """``capacity``: events that can wait to be written (the ring's slots, a power of two);
        more are dropped and counted. ``ring``: map the slots from a file beside the trace, so
        that a crash loses nothing (else from memory). ``packer``: makes each kind's packer in C
        (``probes/fastpath.py``), else ``struct`` packs in Python; ``seqs``: the ring's event
        numbers, the C module's where it packs (``trace/ring.py``'s ``Seqs``)."""
        self.path = path
        self.mono_anchor_ns: int = header["mono_ns"]
        self.dropped = 0
        self._reported_dropped = 0
        self._on_error = on_error
        self._failed = False
        self._closed = False
        self._lock = threading.Lock()  # serialises drains (writer thread vs close)
        self._stop = threading.Event()
        self.on_tick: Callable[[], None] | None = None  # called after each periodic flush
        # The writer thread's CPU seconds so far (it also publishes the status file): what the
        # recording takes from the training process besides the training thread's own pack.
        self.cpu_s = 0.0
        self._opened_ns = time.monotonic_ns()
        # kind -> callback that sees the newest events of that kind as they are written (on
        # this thread, never the training thread): liveness keeps its recent-step summary so.
        self.taps: dict[str, Callable[[tuple], None]] = {}
        self.tap_tail: dict[str, int] = {}  # kind -> the newest events its tap needs (else TAP_TAIL)
        self._meta_taps: deque[tuple] = deque(maxlen=TAP_TAIL)  # tapped metadata, for that thread
        layout = binfmt.layout()
        self._kinds = {name: _Kind(i + 1, spec, packer) for i, (name, spec, _) in enumerate(layout)}
        self._names = {k.kid: name for name, k in self._kinds.items()}
        self._sizes = sizes_of(layout)
        self._ids: dict[Any, int] = {}  # interned value (a str, or a value's JSON text) -> id
        self._values: list[Any] = []
        # The slots; public because the hottest probe (probes/collectives.py) packs into it
        # directly, as ``pack`` does. None once closed or failed.
        self.ring: Ring | None = None
        self.ring_error: BaseException | None = None  # why there is no crash-safe ring, if asked
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._write(binfmt.json_block(binfmt.HEAD, dict(header, layout=layout)))
        if not self._failed:
            if ring:
                try:
                    self.ring = Ring(ring_path(path), self.mono_anchor_ns, capacity, seqs)
                except Exception as exc:  # no room or no mmap: memory alone, lost on a crash
                    self.ring_error = exc
            if self.ring is None:
                self.ring = Ring(None, self.mono_anchor_ns, capacity, seqs)
        self._thread = threading.Thread(
            target=self._run, args=(flush_interval,), name="ddpdoctor-writer", daemon=True
        )
        self._thread.start()

    def put(self, event: tuple) -> None:
        """Record ``(kind, t0_ns, t1_ns, step, *fields)``, or a metadata record stamped with its
        own start, ``(kind, t0_ns, t1_ns, step, {...})`` (a ``raised`` span, a ``fingerprint``)."""
        kind = event[0]
        if kind in schema.META_KINDS:
            self.meta(kind, event[3], event[4], event[1])
            return
        self.record(kind, event[1], event[2], event[3], event[4:])

    def record(self, kind: str, t0: int, t1: int, step: int, fields: tuple) -> None:
        """Hot path: pack one event into the ring. Never blocks, never raises."""
        k = self._kinds.get(kind)
        if k is not None:
            if k.interned or len(fields) != k.n:
                fields = self._prepare(k, fields)
            self.pack(k, t0, t1, step, fields)

    def kind(self, name: str) -> _Kind:
        """How ``name``'s events are packed, for a probe that interns its fields once (with
        ``intern``) and records with ``pack``."""
        return self._kinds[name]

    def pack(self, k: _Kind, t0: int, t1: int, step: int, fields: tuple) -> None:
        """Pack one event whose fields are complete and interned (ids, not strings). The
        collective probe inlines these lines: on its path each call and tuple is a measurable
        part of the cost (docs/overhead.md)."""
        ring = self.ring
        if ring is None:
            return
        if k.fast is not None and k.fast(ring, step, t0, t1, fields) is None:  # packed in C
            return
        seq = ring.seqs.next()
        off = HEADER_BYTES + (seq & ring.mask) * SLOT
        try:
            k.pack_into(ring.mm, off, k.kid, step, t0, t1, *fields, seq)
        except Exception:  # a value that does not fit its declared type
            self.pack_odd(k, ring, off, (step, t0, t1), fields, seq)
        ring.seqs.head = seq

    def _prepare(self, k: _Kind, fields: tuple) -> tuple:
        values = list(fields[: k.n]) + list(k.defaults[len(fields) :])
        ids = self._ids
        for i in k.interned:
            v = values[i]
            sid = ids.get(v) if type(v) is str else None
            values[i] = sid if sid is not None else self.intern(v)
        return tuple(values)

    @staticmethod
    def pack_odd(k: _Kind, ring: Ring, off: int, head: tuple, fields: tuple, seq: int) -> None:
        """Coerce each value to its type (None and what ``int`` refuses become -1) or, where one
        still does not fit, leave the slot void and count the event in ``ring.lost``: the seq
        must be written either way, or the writer would wait for it. The C packer does the same
        (``as_value``, ``write_slot``). Never raises (a ring unmapped by ``close`` under a late
        event loses that event)."""
        try:
            values = [_coerce(v, c) for v, c in zip((*head, *fields), "iii" + k.spec, strict=True)]
            k.pack_into(ring.mm, off, k.kid, *values, seq)
        except Exception:
            ring.lost += 1
            with contextlib.suppress(Exception):
                VOID_SLOT.pack_into(ring.mm, off, VOID, seq)

    def intern(self, value: Any) -> int:
        """The id of ``value`` in this trace's side table, written to the trace when new."""
        key = value if type(value) is str else binfmt._ENCODE(value)
        sid = self._ids.get(key)
        if sid is None:
            sid = len(self._values)
            self._values.append(value if type(value) is str else json.loads(key))
            self._ids[key] = sid
            self._write(binfmt.json_block(binfmt.STRING, [sid, self._values[sid]]))
        return sid

    def meta(self, kind: str, step: int, info: dict[str, Any], t0: int = 0) -> None:
        """Write a metadata record stamped ``t0`` (monotonic ns), else now, at once: they are
        rare. A tapped kind reaches its tap on the writer thread, at the next flush."""
        if not self._failed and not self._closed:
            ts = t0 or time.monotonic_ns()
            self._write(binfmt.json_block(binfmt.META, [kind, ts, 0, step, info]))
            if kind in self.taps:
                self._meta_taps.append((kind, ts, ts, step, info))

    def flush(self) -> None:
        """Write everything recorded so far (any thread)."""
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
            self._drain(final=True)
            if not self._failed:
                now = time.monotonic_ns()
                wall_s = round((now - self._opened_ns) / 1e9, 3)
                info = {"reason": reason, "writer_cpu_s": round(self.cpu_s, 4), "wall_s": wall_s}
                end = [schema.END, now, 0, -1, info]
                self._write(binfmt.json_block(binfmt.META, end))
            self._closed = True
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._drop_ring(unlink=not self._failed)

    def _drop_ring(self, unlink: bool) -> None:
        ring, self.ring = self.ring, None
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
            self.cpu_s = time.thread_time()

    def _drain(self, final: bool = False) -> None:
        ring = self.ring
        if self._failed or self._closed or ring is None:
            return
        parts, lo, hi, lost = ring.take(self._sizes, final)
        self.dropped += lost
        if hi > lo:
            self._write(binfmt.events_block(parts, lo, hi))
            if self.taps:
                self._tap(parts)
        while self._meta_taps:
            event = self._meta_taps.popleft()
            tap = self.taps.get(event[0])
            if tap is not None:
                with contextlib.suppress(Exception):  # a tap that fails must not cost the trace
                    tap(event)
        count = self.dropped + ring.lost
        if count != self._reported_dropped:
            self._reported_dropped = count
            dropped = [schema.DROPPED, time.monotonic_ns(), 0, -1, {"count": count}]
            self._write(binfmt.json_block(binfmt.META, dropped))

    def _tap(self, parts: list[Part]) -> None:
        """Hand each tap the newest events of its kind, as tuples (bounded per flush)."""
        for kid, data, count in parts:
            name = self._names.get(kid)
            tap = self.taps.get(name) if name is not None else None
            if tap is None:
                continue
            k = self._kinds[name]
            rec = np.frombuffer(data, k.dtype, count)[-self.tap_tail.get(name, TAP_TAIL) :]
            for row in rec.tolist():
                step, t0, t1, *fields = row
                for i in k.interned:
                    fields[i] = self._values[fields[i]] if fields[i] < len(self._values) else "?"
                with contextlib.suppress(Exception):  # a tap that fails must not cost the trace
                    tap((name, t0, t1, step, *fields))

    def _write(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except (OSError, ValueError) as exc:
            self._failed = True
            self._drop_ring(unlink=True)  # the trace stops here: nothing to complete it with
            if self._on_error is not None:
                self._on_error(exc)


def _coerce(v: Any, code: str) -> Any:
    if code == "f":
        return float(v) if isinstance(v, (int, float)) else 0.0
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return -1
