"""The binary trace file: blocks of fixed-size records, read with ``np.frombuffer``.

A trace is a sequence of blocks, each ``<4s tag><u32 length><payload>``, appended with one
``write`` each (``O_APPEND``), so a block is whole or is the torn last one, which readers drop:

``HEAD``  the JSON header (``schema.SCHEMA``...) with ``layout``: ``[[kind, spec, fields]...]``,
          kind id = position + 1. Readers use the file's own layout, not their schema's, so a
          file recorded with more or fewer fields or kinds still reads.
``STR_``  JSON ``[id, value]``: one interned value (a string, or a list/dict for "v" fields),
          written once, before any record that refers to it.
``META``  JSON ``[kind, mono_ns, 0, step, {...}]``: a metadata record, stamped on the same
          monotonic clock as the events (the header's ``mono_ns`` anchors both).
``EVTS``  ``<u64 seq_lo><u64 seq_hi><u32 parts>``, then per part ``<u16 kind id><u32 count>``
          and ``count`` records of that kind (``schema.record_dtype``): the events numbered
          ``[seq_lo, seq_hi)`` by the recording ring (``trace/ring.py``), grouped by kind, in
          order within a kind.

A file whose header block was cut or damaged (a disk that filled at the first write) still
reads: the blocks after it are found again, the events decoded with this version's layout
(``Decoded.header_cut``), their times left on the rank's monotonic clock for
``trace/recover.py`` to place.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddpdoctor.trace import schema

HEAD, STRING, META, EVENTS = b"HEAD", b"STR_", b"META", b"EVTS"
_BLOCK = struct.Struct("<4sI")
_BATCH = struct.Struct("<QQI")
_PART = struct.Struct("<HI")
_ENCODE = json.JSONEncoder(separators=(",", ":"), default=str).encode
FORMAT_VERSION = 3  # the trace schema version of binary files (``ddpdoctor.trace/3``)


def block(tag: bytes, payload: bytes) -> bytes:
    return _BLOCK.pack(tag, len(payload)) + payload


def json_block(tag: bytes, value: Any) -> bytes:
    return block(tag, _ENCODE(value).encode())


def layout() -> list[list[Any]]:
    """This version's record layout, as a trace header carries it."""
    return [[k.name, k.spec, list(k.fields)] for k in schema.KINDS.values()]


def is_binary(head: bytes) -> bool:
    return head[:4] == HEAD


def events_block(parts: list[tuple[int, bytes, int]], seq_lo: int, seq_hi: int) -> bytes:
    """An EVTS block from (kind id, records' bytes, count) parts."""
    out = [_BATCH.pack(seq_lo, seq_hi, len(parts))]
    for kid, data, count in parts:
        out += [_PART.pack(kid, count), data]
    return block(EVENTS, b"".join(out))


_TAGS = (HEAD, STRING, META, EVENTS)


def blocks(data: bytes | memoryview, pos: int = 0) -> Iterator[tuple[bytes, int, int]]:
    """(tag, payload start, payload end) of every whole block from ``pos``; stops at a torn one."""
    size = len(data)
    while pos + _BLOCK.size <= size:
        tag, n = _BLOCK.unpack_from(data, pos)
        start = pos + _BLOCK.size
        if start + n > size:
            return
        yield tag, start, start + n
        pos = start + n


@dataclass
class Decoded:
    """A binary trace's contents: the header, interned values, metadata records and each
    kind's records (structured arrays in the file's layout)."""

    header: dict[str, Any] | None = None
    strings: dict[int, Any] = field(default_factory=dict)
    meta: list[list[Any]] = field(default_factory=list)
    records: dict[str, np.ndarray] = field(default_factory=dict)
    specs: dict[str, str] = field(default_factory=dict)
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    seq_hi: int = 0  # events numbered below this are in the file
    header_cut: bool = False  # the header block was unreadable: the blocks after it kept
    end: int = 0  # bytes of whole blocks
    skipped: int = 0  # unreadable blocks

    @property
    def anchor(self) -> int:
        return int((self.header or {}).get("mono_ns", 0))


def decode(data: bytes, events: bool = True) -> Decoded:
    """Read a binary trace (``events=False``: all but the event records, for a quick look)."""
    out = Decoded()
    kinds: dict[int, tuple[str, np.dtype]] = {}
    pieces: dict[int, list[memoryview]] = {}
    view = memoryview(data)
    pos = 0
    if data and _unreadable_head(data):
        out.header_cut = True
        pos = _resync(data, 1)
        kinds = {i + 1: (name, schema.record_dtype(spec)) for i, (name, spec, _) in enumerate(layout())}
        for name, spec, names in layout():
            out.specs[name], out.names[name] = spec, tuple(names)
        out.skipped += 1
    for tag, start, end in blocks(data, pos):
        out.end = end
        if tag == EVENTS:
            lo, hi, nparts = _BATCH.unpack_from(data, start)
            out.seq_hi = max(out.seq_hi, hi)
            if not events:
                continue
            pos = start + _BATCH.size
            for _ in range(nparts):
                kid, count = _PART.unpack_from(data, pos)
                pos += _PART.size
                kind = kinds.get(kid)
                if kind is None:
                    out.skipped += 1
                    break
                size = kind[1].itemsize * count
                pieces.setdefault(kid, []).append(view[pos : pos + size])
                pos += size
            continue
        try:
            value = json.loads(view[start:end].tobytes())
        except ValueError:
            out.skipped += 1
            continue
        if tag == STRING and isinstance(value, list) and len(value) == 2:
            out.strings[int(value[0])] = value[1]
        elif tag == META and isinstance(value, list) and len(value) == 5 and isinstance(value[4], dict):
            out.meta.append(value)
        elif tag == HEAD and isinstance(value, dict) and out.header is None:
            out.header = value
            for i, (name, spec, names) in enumerate(value.get("layout") or []):
                kinds[i + 1] = (name, schema.record_dtype(spec))
                out.specs[name], out.names[name] = spec, tuple(names)
        else:
            out.skipped += 1
    for kid, parts in pieces.items():
        name, dtype = kinds[kid]
        out.records[name] = np.frombuffer(b"".join(parts), dtype=dtype)
    return out


def _unreadable_head(data: bytes) -> bool:
    for tag, start, end in blocks(data):
        try:
            return tag != HEAD or not isinstance(json.loads(data[start:end]), dict)
        except ValueError:
            return True
    return True


def _resync(data: bytes, pos: int) -> int:
    """Where the whole blocks after a damaged one start: the first tag from ``pos`` whose chain
    of blocks runs to the file's end (its last block may be torn)."""
    size = len(data)
    while True:
        found = [p for p in (data.find(t, pos) for t in _TAGS) if p >= 0]
        if not found:
            return size
        p = at = min(found)
        whole = 0
        while at + _BLOCK.size <= size:
            tag, n = _BLOCK.unpack_from(data, at)
            if tag not in _TAGS:
                break
            at += _BLOCK.size + n
            whole += at <= size
        if at + _BLOCK.size > size and whole:  # reached the end, or a torn last block
            return p
        pos = p + 1


def value(strings: dict[int, Any], sid: int) -> Any:
    return strings.get(sid, "?")


def records(dec: Decoded) -> list[list[Any]]:
    """The trace as the JSON-lines records of format 2 (``[kind, ts_us, dur_us, step,
    *fields]``), header first, then by time: the export for people who grep traces."""
    anchor = dec.anchor
    rows: list[tuple[int, list[Any]]] = []
    for kind, ts, dur, step, info in dec.meta:
        t = (int(ts) - anchor) // 1000
        rows.append((t, [kind, t, dur, step, info]))
    for kind, rec in dec.records.items():
        spec = dec.specs[kind]
        cols = [rec[f"f{i}"].tolist() for i in range(len(spec))]
        for j, code in enumerate(spec):
            if code in schema.INTERNED:
                cols[j] = [value(dec.strings, s) for s in cols[j]]
        t0, t1 = rec["t0"].astype(np.int64), rec["t1"].astype(np.int64)
        ts, dur = ((t0 - anchor) // 1000).tolist(), ((t1 - t0) // 1000).tolist()
        for i, (t, d, s) in enumerate(zip(ts, dur, rec["step"].tolist(), strict=True)):
            rows.append((t, [kind, t, d, s, *(c[i] for c in cols)]))
    rows.sort(key=lambda r: (r[1][0] == schema.END, r[0]))
    header = dict(dec.header or {})
    header.pop("layout", None)
    header["schema"] = schema.JSONL_SCHEMA
    return [[schema.HEADER, header]] + [r for _, r in rows]
