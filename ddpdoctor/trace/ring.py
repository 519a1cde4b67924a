"""A crash-safe copy of a rank's recent events: a memory-mapped ring beside its trace file.

The JSON-lines trace is written by a thread every fraction of a second, so the events of the
last interval live only in the process's memory; a rank that dies by SIGABRT (a C++ abort in
gloo/NCCL), SIGSEGV, SIGKILL or ``os._exit`` would lose exactly the steps that explain its
death. Each accepted event is therefore also copied, on the recording thread, into a shared
file mapping (``MAP_SHARED``): those pages belong to the kernel's page cache, so what was
written survives the death of the process. After the job, ``complete_trace`` appends to the
trace whatever the ring holds beyond the events the trace already has; the reader never sees
the ring.

The file ``trace-rank{R}[-attemptN].ring`` (space reserved up front with ``posix_fallocate``,
so a full disk fails here, at creation, and never as a SIGBUS while training)::

    header, 64 bytes: magic b"DDPRING1", u32 slot size, u32 slot count, u64 mono_ns anchor,
                      u32 pid (little-endian)
    slots, each SLOT bytes: u64 seq, u32 length, u16 part, u16 parts, then payload

An event is the ``marshal`` encoding of the tuple given to ``TraceWriter.put`` (kind, t0 ns,
t1 ns, step, *fields); one longer than a slot's payload takes ``parts`` slots (the next free
ones, each with the same ``seq`` and its ``part`` number). ``seq`` numbers the events the
writer's queue accepted, from 1, in the order they were queued; the trace's n-th event line is
event n, so a trace with n event lines lacks exactly the events with seq > n. The header of a
slot is written after its payload: a slot caught mid-write keeps its old seq, which only a
record the ring already lapped can carry.
Events put by two threads at the same instant may be numbered in the other order than they
were queued; a death at that instant can then repeat one event and lose its neighbour.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import marshal
import mmap
import os
import struct
from typing import Any

from ddpdoctor.trace import schema

MAGIC = b"DDPRING1"
_HEAD = struct.Struct("<8sIIQI")
HEADER_BYTES = 64
SLOT = 128
_SLOT_HEAD = struct.Struct("<QIHH")
_PAYLOAD = SLOT - _SLOT_HEAD.size
DEFAULT_SLOTS = 32768  # 4 MiB: ~16 s of a job recording 2000 events a second
SLOTS_ENV = "DDPDOCTOR_RING_SLOTS"
_MAX_PARTS = 64  # longer records (a huge bucket layout) are left to the JSON trace alone
_ENCODE = json.JSONEncoder(separators=(",", ":"), default=str).encode
_dumps = marshal.dumps


def ring_path(trace_path: str | os.PathLike[str]) -> str:
    trace_path = os.fspath(trace_path)
    base = trace_path[: -len(".jsonl")] if trace_path.endswith(".jsonl") else trace_path
    return base + ".ring"


class Ring:
    """The writing side, owned by one rank's TraceWriter."""

    def __init__(self, path: str, mono_anchor_ns: int, slots: int | None = None) -> None:
        if slots is None:
            slots = int(os.environ.get(SLOTS_ENV, str(DEFAULT_SLOTS)))
        self.path = path
        self.slots = 1 << max(2, slots.bit_length() - 1)  # a power of two: a mask, not a modulo
        self._mask = self.slots - 1
        self.pid = os.getpid()
        size = HEADER_BYTES + self.slots * SLOT
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a page fault later
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)
        _HEAD.pack_into(self._mm, 0, MAGIC, SLOT, self.slots, mono_anchor_ns, self.pid)
        self._next = itertools.count(1).__next__  # event numbers; atomic under the GIL
        self._slot = itertools.count(0).__next__  # slot positions (a long event takes several)

    def put(self, event: tuple) -> None:
        """Copy one event into the ring (about a microsecond); raises only if the ring broke."""
        try:
            data = _dumps(event, 2)  # version 2: no reference tracking, a third faster than 4
        except ValueError:  # an object marshal cannot encode: keep what the JSON line would say
            data = _dumps(json.loads(_ENCODE(event)), 2)
        seq = self._next()
        n = len(data)
        mm = self._mm
        if n <= _PAYLOAD:
            off = HEADER_BYTES + (self._slot() & self._mask) * SLOT
            mm[off + 16 : off + 16 + n] = data
            _SLOT_HEAD.pack_into(mm, off, seq, n, 0, 1)
            return
        parts = -(-n // _PAYLOAD)
        if parts > _MAX_PARTS:
            return
        for part in range(parts):  # a rare long record: its parts in any slots, numbered
            off = HEADER_BYTES + (self._slot() & self._mask) * SLOT
            chunk = data[part * _PAYLOAD : (part + 1) * _PAYLOAD]
            mm[off + 16 : off + 16 + len(chunk)] = chunk
            _SLOT_HEAD.pack_into(mm, off, seq, n, part, parts)

    def close(self, unlink: bool) -> None:
        """Unmap; remove the file when the trace was completed by the writer itself."""
        with contextlib.suppress(Exception):
            self._mm.close()
        if unlink and os.getpid() == self.pid:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def read_ring(path: str) -> tuple[dict[str, Any], dict[int, tuple]]:
    """The ring's header and its complete events by seq."""
    with open(path, "rb") as fh:
        data = fh.read()
    magic, slot, slots, anchor, pid = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or slot != SLOT:
        raise ValueError(f"{path}: not a ddpdoctor ring")
    parts: dict[int, dict[int, bytes]] = {}
    sizes: dict[int, tuple[int, int]] = {}
    for i in range(slots):
        off = HEADER_BYTES + i * SLOT
        if off + SLOT > len(data):
            break
        seq, n, part, count = _SLOT_HEAD.unpack_from(data, off)
        if seq == 0 or count == 0:
            continue
        size = min(n, _PAYLOAD) if count == 1 else min(_PAYLOAD, n - part * _PAYLOAD)
        parts.setdefault(seq, {})[part] = data[off + 16 : off + 16 + size]
        sizes[seq] = (n, count)
    events: dict[int, tuple] = {}
    for seq, got in parts.items():
        n, count = sizes[seq]
        if len(got) != count:
            continue  # a long record partly overwritten
        blob = b"".join(got[p] for p in range(count) if p in got)
        if len(blob) != n:
            continue
        with contextlib.suppress(Exception):
            events[seq] = tuple(marshal.loads(blob))
    return {"slots": slots, "mono_ns": anchor, "pid": pid}, events


def _event_lines(data: bytes) -> int:
    """How many event records a trace file holds (lines that are not header/dropped/end)."""
    lines = data.count(b"\n")
    other = sum(data.count(b'\n["' + k.encode() + b'",') for k in (schema.DROPPED, schema.END))
    return lines - other - (1 if data.startswith(b'["' + schema.HEADER.encode()) else 0)


def complete_trace(trace_path: str | os.PathLike[str]) -> dict[str, int] | None:
    """Append to ``trace_path`` the events its ring holds and it lacks; remove the ring.

    Returns ``{"recovered": n, "lost": m}`` (m: events the ring had already overwritten), or
    None when there is no ring or the trace ended cleanly. Safe to run twice.
    """
    trace_path = os.fspath(trace_path)
    rpath = ring_path(trace_path)
    if not os.path.isfile(rpath):
        return None
    if not os.path.isfile(trace_path):  # a trace that is not a regular file (tests: /dev/full)
        return None
    with open(trace_path, "rb") as fh:
        data = fh.read()
    if not data.startswith(b'["' + schema.HEADER.encode()):
        return None
    end = data.rfind(b"\n") + 1
    tail_cut = end < len(data)
    data = data[:end]
    if data.rfind(b'\n["' + schema.END.encode() + b'",') >= 0:
        with contextlib.suppress(OSError):
            os.unlink(rpath)
        return None
    header, events = read_ring(rpath)
    anchor = int(json.loads(data[: data.find(b"\n")])[1]["mono_ns"])
    have = _event_lines(data)
    missing = sorted(s for s in events if s > have)
    lines: list[str] = []
    lost = (missing[0] - have - 1) if missing else 0
    last_t = anchor
    for seq in missing:
        kind, t0, t1, step, *fields = events[seq]
        last_t = max(last_t, t1)
        lines.append(_ENCODE([kind, (t0 - anchor) // 1000, (t1 - t0) // 1000, step, *fields]))
    if lost > 0:
        lines.append(_ENCODE([schema.DROPPED, (last_t - anchor) // 1000, 0, -1, {"count": lost}]))
    if tail_cut:
        with open(trace_path, "r+b") as fh:
            fh.truncate(end)  # a line cut by the death: its event is in the ring
    if lines:
        with open(trace_path, "a", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
    with contextlib.suppress(OSError):
        os.unlink(rpath)
    return {"recovered": len(missing), "lost": max(0, lost)}
