"""The recording ring: a memory-mapped array of fixed-size slots that the training thread
writes each event into, and from which the trace is written and, after a death, completed.

Recording an event is one ``struct.pack_into`` of its kind's layout into the next slot: no
formatting, no lock, no I/O. The trace writer's thread takes the filled slots every fraction
of a second, groups them by kind with numpy and appends them to the trace as one block
(``trace/binfmt.py``). The mapping is a file (``MAP_SHARED``): its pages belong to the kernel's
page cache, so what a rank wrote survives its death by SIGABRT, SIGSEGV, SIGKILL or
``os._exit``, and after the job ``complete_trace`` appends to the trace the events it lacks.

The file ``trace-rank{R}[-attemptN].ring`` (space reserved up front with ``posix_fallocate``,
so a full disk fails here, at creation, and never as a SIGBUS while training)::

    header, 64 bytes: magic b"DDPRING2", u32 slot size, u32 slot count, u64 mono_ns anchor,
                      u32 pid (little-endian); at byte 28 b"CALL", then the collective
                      the training thread entered last: i64 sequence number, i32 signature
                      id, i32 site id (-1s before the first), written before the call (a
                      ring from before these fields has zeros there, and no tag)
    slots, each SLOT bytes: u16 kind id, 2 bytes unused, the record (``schema.record_dtype``
    of the kind: step, t0, t1, fields), then at byte 120 the u64 seq of the event

``seq`` numbers the events from 1 in the order slots were claimed; slot = seq mod slots. The
seq is packed last, after the record: a slot caught mid-write keeps its old seq. A slot whose
kind id is ``VOID`` holds no event (a value that did not fit its declared type). The ring never
blocks: a writer a whole ring behind (a stalled disk) loses the oldest events, and counts them
in a ``dropped`` record; the newest, which explain a death, stay. Nor does a slot claimed and
never written hold back the events after it: a signal handler's exception raised between a
Python writer's claim and its pack (the eval loop runs handlers after any call) leaves one so;
once it was claimed ``ABANDONED_NS`` ago the writer counts it lost and goes on.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ddpdoctor import _env
from ddpdoctor.trace import binfmt, notes, schema

MAGIC = b"DDPRING2"
_HEAD = struct.Struct("<8sIIQI")
HEADER_BYTES = 64
SLOT = 128
SEQ_AT = 120
BODY_AT = 4
VOID = 0xFFFF
VOID_SLOT = struct.Struct(f"<H{SEQ_AT - 2}xQ")
# The collective a rank entered last: its record is written as the call returns, so a rank
# killed inside a call (gloo aborts on a size it did not expect) leaves only this of it.
CALL = struct.Struct("<qii")
CALL_AT = 32
CALL_TAG = b"CALL"  # at byte 28: the field is there
# Linux's 23, which this Python's mmap does not name
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else None)
# A slot claimed this long ago and still unwritten is abandoned: a write takes microseconds
ABANDONED_NS = 1_000_000_000
Sizes = tuple[int, ...]  # a kind id's record bytes at its index (``sizes_of``)
Part = tuple[int, bytes, int]  # one kind's events in a block: (kind id, records' bytes, count)


def ring_path(trace_path: str | os.PathLike[str]) -> str:
    return os.path.splitext(os.fspath(trace_path))[0] + ".ring"


def slot_struct(spec: str) -> struct.Struct:
    """The ``struct`` a kind's events are packed with into a slot: kind id, step, t0, t1,
    the fields, the seq."""
    codes = "".join(schema.FIELD_TYPES[c][1] for c in spec)
    body = schema.record_dtype(spec).itemsize
    return struct.Struct(f"<H2xiqq{codes}{SEQ_AT - BODY_AT - body}xQ")


class Seqs:
    """A ring's event numbers: ``next()`` claims the next seq (from 1), ``head`` is the last
    written (by any thread). The probes' C module holds the same in C (``_fast.RingSeqs``, with
    the mapping), so that its records touch no Python object; this is the Python path's."""

    __slots__ = ("next", "head")

    def __init__(self, mm: mmap.mmap, mask: int) -> None:
        self.next = itertools.count(1).__next__  # atomic under the GIL
        self.head = 0

    def release(self) -> None:
        """Nothing is held of the mapping here (``_fast.RingSeqs`` lets go of it)."""


class Ring:
    """The slots, mapped from ``path`` (crash-safe) or anonymous memory (``path`` None).
    ``seqs``: makes the ring's :class:`Seqs` from its mapping and mask (the C module's, where
    built: ``probes/fastpath.py``)."""

    def __init__(
        self,
        path: str | None,
        mono_anchor_ns: int,
        slots: int | None = None,
        seqs: Callable[[mmap.mmap, int], Any] = Seqs,
    ) -> None:
        slots = int(slots or _env.BUFFER_EVENTS_N)
        self.path = path
        self.slots = 1 << max(2, slots.bit_length() - 1)  # a power of two: a mask, not a modulo
        self.mask = self.slots - 1
        self.pid = os.getpid()
        size = HEADER_BYTES + self.slots * SLOT
        if path is None:
            self.mm = mmap.mmap(-1, size)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a page fault later
                self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
            os.close(fd)
        _populate(self.mm)
        _HEAD.pack_into(self.mm, 0, MAGIC, SLOT, self.slots, mono_anchor_ns, self.pid)
        self.mm[CALL_AT - 4 : CALL_AT] = CALL_TAG
        CALL.pack_into(self.mm, CALL_AT, -1, -1, -1)
        self.seqs = seqs(self.mm, self.mask)  # the event numbers: claimed, last written
        self.taken = 0  # the last seq taken by the writer: slots above it are not free
        self.lost = 0  # events whose values did not fit their types even coerced: slots void
        self._mark = (time.monotonic_ns(), 0)  # a take's time and head, rolled ABANDONED_NS on
        self._stale = 0  # a head from ABANDONED_NS ago or more: slots up to it were claimed then

    def take(self, sizes: Sizes, final: bool = False) -> tuple[list[Part], int, int, int]:
        """(parts, seq_lo, seq_hi, lost): the slots written since the last take, in seq order,
        numbered ``[seq_lo, seq_hi)`` and grouped by kind (``group``); a slot still being
        written by another thread waits for the next take, unless it was claimed
        ``ABANDONED_NS`` ago or the take is the ``final`` one; ``lost``: events overwritten
        before they were taken, or abandoned. In one C call where the C module holds the seqs
        (``_fast.RingSeqs.take``), else with numpy."""
        lo, hi = self.taken + 1, self.seqs.head
        now = time.monotonic_ns()
        if now - self._mark[0] >= ABANDONED_NS:
            self._stale, self._mark = self._mark[1], (now, hi)
        if hi < lo:
            return [], lo, lo, 0
        lapped = max(0, hi - lo + 1 - self.slots)  # overwritten before this take
        lo += lapped
        in_c = getattr(self.seqs, "take", None)
        if in_c is not None:
            parts, kept, void = in_c(lo, hi, self._stale, final, sizes)
        else:
            rows, kept, void = self._rows(lo, hi, final)
            parts = group(rows, sizes)
        self.taken = lo + kept - 1
        return parts, lo - lapped, self.taken + 1, lapped + void

    def _rows(self, lo: int, hi: int, final: bool) -> tuple[np.ndarray, int, int]:
        """(the written slots of ``lo..hi`` up to the first still being written, how many slots
        that take in, how many of those were overwritten): ``take`` with numpy."""
        seqs_want = np.arange(lo, hi + 1, dtype=np.uint64)
        buf = np.frombuffer(self.mm, np.uint8, self.slots * SLOT, HEADER_BYTES).reshape(self.slots, SLOT)
        first, count = lo & self.mask, hi + 1 - lo
        if first + count <= self.slots:
            rows = buf[first : first + count].copy()
        else:  # the slots wrap around the end of the ring: two slices
            rows = np.concatenate([buf[first:], buf[: first + count - self.slots]])
        del buf
        seqs = rows[:, SEQ_AT:].copy().view("<u8")[:, 0]
        # a slot claimed by the stale head and still unwritten never will be: lost, not waited for
        pending = np.flatnonzero((seqs < seqs_want) & (seqs_want > self._stale))
        if len(pending) and not final:
            cut = int(pending[0])
            rows, seqs, seqs_want = rows[:cut], seqs[:cut], seqs_want[:cut]
        mine = seqs == seqs_want
        return rows[mine], len(rows), int((~mine).sum())

    def close(self, unlink: bool) -> None:
        """Unmap; remove the file, and the C++ timer's notes beside it, when the trace was
        completed by the writer itself."""
        with contextlib.suppress(Exception):
            self.seqs.release()
            self.mm.close()
        if unlink and self.path is not None and os.getpid() == self.pid:
            for path in (self.path, notes.notes_path(self.path)):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def group(rows: np.ndarray, sizes: Sizes) -> list[Part]:
    """Slots (in seq order) as (kind id, records' bytes, count) parts, one per kind present."""
    if not len(rows):
        return []
    kinds = rows[:, :2].copy().view("<u2")[:, 0]
    parts = []
    for kid in np.unique(kinds).tolist():
        size = sizes[kid] if kid < len(sizes) else 0
        if not size:
            continue
        sel = rows[kinds == kid, BODY_AT : BODY_AT + size]
        parts.append((kid, sel.tobytes(), len(sel)))
    return parts


def sizes_of(layout: list[list[Any]]) -> Sizes:
    """Each kind id's record bytes, from a header's layout (0 at 0: no kind has that id)."""
    return (0, *(schema.record_dtype(spec).itemsize for _, spec, _ in layout))


def _populate(mm: mmap.mmap) -> None:
    """Map every page writable now (``MADV_POPULATE_WRITE``, Linux 5.14+): else the training
    thread takes a page fault on the first event of each page, 4 µs here every 32 events of the
    ring's first lap (the filesystem's ``page_mkwrite`` for a file), 6 ms once at creation here.
    Elsewhere nothing changes."""
    if MADV_POPULATE_WRITE is not None:
        with contextlib.suppress(AttributeError, OSError, ValueError):  # no madvise, an old kernel
            mm.madvise(MADV_POPULATE_WRITE)


def read_ring(path: str) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """The ring's header, its written slots and their seqs (in seq order)."""
    with open(path, "rb") as fh:
        data = fh.read()
    magic, slot, slots, anchor, pid = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or slot != SLOT:
        raise ValueError(f"{path}: not a ddpdoctor ring of this version")
    count = min(slots, (len(data) - HEADER_BYTES) // SLOT)
    rows = np.frombuffer(data, np.uint8, count * SLOT, HEADER_BYTES).reshape(count, SLOT)
    seqs = rows[:, SEQ_AT:].copy().view("<u8")[:, 0]
    order = np.argsort(seqs, kind="stable")
    order = order[seqs[order] > 0]
    seq, sid, site = CALL.unpack_from(data, CALL_AT)
    tagged = data[CALL_AT - 4 : CALL_AT] == CALL_TAG
    entered = {"seq": seq, "signature": sid, "site": site} if tagged and sid >= 0 else None
    return {"slots": slots, "mono_ns": anchor, "pid": pid, "entered": entered}, rows[order], seqs[order]


def complete_trace(trace_path: str | os.PathLike[str]) -> dict[str, int] | None:
    """Append to ``trace_path`` the events its ring holds and it lacks, and the C++ bucket
    timer's notes that never reached the ring (``trace/notes.py``); remove both files.

    Returns ``{"recovered": n, "lost": m}`` (m: events the ring, and notes the notes file, had
    already overwritten), or None when there is no ring or the trace ended cleanly. Safe to run
    twice.
    """
    trace_path = os.fspath(trace_path)
    rpath, npath = ring_path(trace_path), notes.notes_path(trace_path)
    if not os.path.isfile(rpath) or not os.path.isfile(trace_path):
        return None  # no ring, or a trace that is not a regular file (tests: /dev/full)
    with open(trace_path, "rb") as fh:
        data = fh.read()
    if not binfmt.is_binary(data):
        return None
    dec = binfmt.decode(data, events=False)
    if dec.header is None:
        return None
    if any(m[0] == schema.END for m in dec.meta):
        for path in (rpath, npath):
            with contextlib.suppress(OSError):
                os.unlink(path)
        return None
    layout = dec.header.get("layout") or []
    head, every, seqs = read_ring(rpath)
    keep = seqs >= max(dec.seq_hi, 1)
    rows, seqs = every[keep], seqs[keep]
    kinds = rows[:, :2].copy().view("<u2")[:, 0] if len(rows) else np.zeros(0, np.uint16)
    real = kinds != VOID
    lost = int(seqs[0]) - max(dec.seq_hi, 1) if len(seqs) else 0
    out, recovered = [], int(real.sum())
    if len(rows):
        parts = group(rows[real], sizes_of(layout))
        out.append(binfmt.events_block(parts, int(seqs[0]), int(seqs[-1]) + 1))
    part, missed = _uncommitted_notes(npath, layout, every) if os.path.isfile(npath) else (None, 0)
    if part is not None:
        hi = max(int(seqs[-1]) + 1 if len(seqs) else 0, dec.seq_hi)
        out.append(binfmt.events_block([part], hi, hi))  # numbered by no ring: an empty range
        recovered += part[2]
    lost = max(0, lost) + missed
    if lost > 0:
        last = rows[real][:, BODY_AT + 12 : BODY_AT + 20].copy().view("<i8") if real.any() else None
        last_ns = int(last.max()) if last is not None else dec.anchor
        out.append(binfmt.json_block(binfmt.META, [schema.DROPPED, last_ns, 0, -1, {"count": lost}]))
    if head["entered"] is not None:  # the analysis tells a call that returned from one it died in
        out.append(binfmt.json_block(binfmt.META, [schema.ENTERED, dec.anchor, 0, -1, head["entered"]]))
    with open(trace_path, "r+b") as fh:
        if dec.end < len(data):
            fh.truncate(dec.end)  # a block cut by the death: its events are in the ring
        fh.seek(0, os.SEEK_END)
        fh.write(b"".join(out))
    for path in (rpath, npath):
        with contextlib.suppress(OSError):
            os.unlink(path)
    return {"recovered": recovered, "lost": lost}


def _uncommitted_notes(
    path: str, layout: list[list[Any]], ring_rows: np.ndarray
) -> tuple[tuple[int, bytes, int] | None, int]:
    """(the bucket records of the notes the rank had not committed, as an events part, or None;
    notes lost). A note packed into the ring just before the death, uncommitted, is in the
    ring's slots already: the same start and bucket index there leave it out."""
    kid = next((i + 1 for i, (name, _, _) in enumerate(layout) if name == schema.ALLREDUCE), 0)
    if not kid:
        return None, 0
    try:
        rows, lost = notes.notes_since_commit(path)
    except (OSError, ValueError):
        return None, 0
    dtype = schema.record_dtype(layout[kid - 1][1])
    recs = notes.records(rows, dtype)
    if len(ring_rows) and len(recs):
        ids = ring_rows[:, :2].copy().view("<u2")[:, 0]
        mine = ring_rows[ids == kid, BODY_AT : BODY_AT + dtype.itemsize].copy().view(dtype)[:, 0]
        packed = set(zip(mine["t0"].tolist(), mine["f0"].tolist(), strict=True))
        keys = zip(recs["t0"].tolist(), recs["f0"].tolist(), strict=True)
        recs = recs[np.array([key not in packed for key in keys], bool)]
    return ((kid, recs.tobytes(), len(recs)) if len(recs) else None), lost
