"""The C++ bucket timer's notes file: each gradient bucket's all-reduce, kept where a death
cannot take it before it reaches the trace.

The timer (``probes/_hook.cpp``) writes a note when a bucket's all-reduce completes, on the
thread that completed it, into ``trace-rank{R}.notes`` beside the recording ring: a slot
claimed with an atomic counter, the note's number stored last. The writer thread packs the
notes into the ring four times a second and then commits their number into the header; after
a death, ``notes_since_commit`` gives ``ring.complete_trace`` the notes that were not yet
packed. So after the first steps (``commhook.drain_settling``) the training thread no longer
drains the timer, and no completed bucket is lost::

    header, 64 bytes: magic b"DDPNOTE1", u32 slot bytes, u32 slot count, u64 notes claimed,
                      u64 notes committed to the ring, u32 pid (little-endian)
    slots, each 64 bytes: six int64 (step, t0 ns, t1 ns, bucket index, bytes, group seq),
                      then at byte 48 the u64 number of the note (from 1)
"""

from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"DDPNOTE1"
_HEAD = struct.Struct("<8sIIQQI")
HEADER_BYTES = 64
SLOT = 64
NOTE_FIELDS = 6  # step, t0, t1, then the bucket record's fields: index, bytes, seq
NOTE = struct.Struct(f"<{NOTE_FIELDS}q")  # a note as ``drain_notes`` hands it over: int64 each
SEQ_AT = 48


def notes_path(trace_path: str | os.PathLike[str]) -> str:
    return os.path.splitext(os.fspath(trace_path))[0] + ".notes"


def notes_since_commit(path: str) -> tuple[np.ndarray, int]:
    """(the notes written after the last commit, as an (n, 6) int64 array in order; how many of
    them a later note overwrote). Raises ValueError for a file that is not a notes file."""
    with open(path, "rb") as fh:
        data = fh.read()
    if len(data) < HEADER_BYTES:
        raise ValueError(f"{path}: not a ddpdoctor notes file (cut short)")
    magic, slot, slots, claimed, committed, _ = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or slot != SLOT:
        raise ValueError(f"{path}: not a ddpdoctor notes file of this version")
    count = min(slots, (len(data) - HEADER_BYTES) // SLOT)
    rows = np.frombuffer(data, "<i8", count * SLOT // 8, HEADER_BYTES).reshape(count, SLOT // 8)
    seqs = rows[:, SEQ_AT // 8].astype(np.uint64)
    keep = np.flatnonzero(seqs > committed)
    keep = keep[np.argsort(seqs[keep], kind="stable")]
    lost = max(0, int(claimed) - int(committed) - len(keep))
    return rows[keep, :NOTE_FIELDS].copy(), lost


def records(notes: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Notes as bucket all-reduce records of ``dtype`` (``schema.record_dtype``): the C packer's
    mapping, a note's values in order; a note whose values do not fit the types is left out,
    as the packer leaves its slot void."""
    out = np.zeros(len(notes), dtype)
    fit = np.ones(len(notes), bool)
    for j, name in enumerate(dtype.names):
        kind = dtype[name]
        if kind.kind in "iu" and kind.itemsize < 8:
            info = np.iinfo(kind)
            fit &= (notes[:, j] >= info.min) & (notes[:, j] <= info.max)
    for j, name in enumerate(dtype.names):
        out[name] = notes[:, j].astype(dtype[name])
    return out[fit]
