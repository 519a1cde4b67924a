"""Handing the read workers' rank traces to the parent through shared memory, not a pipe.

A rank's packed columns are about 570 KB at 10,000 steps. Sent through the pool's pipe, a
1,024-rank run moves 580 MB through it 64 KB at a time: each worker blocks on its writes until
the parent's result thread reads them, and the parent spends 2-3 s of CPU receiving and
unpickling (every byte copied into a pipe, out of it, and again into its arrays). Here a worker
pickles the trace with its arrays out of band (pickle protocol 5) into a slot of a ring of
memory shared with the parent (an anonymous shared mapping, inherited when the pool forks);
only the small pickle goes through the pipe. The parent copies each array out of the slot
into memory of its own (the arrays it keeps are its own, as unpickled ones were) and hands the
slot to the next rank. A trace too large for a slot goes through the pipe as before.
"""

from __future__ import annotations

import mmap
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np

ALIGN = 64  # each array's bytes start on a cache line in the slot
SLOT_BYTES = 8 << 20  # 8 MB: 14 times a rank of 1,024 x 10,000 (the bytes touched are used)
SLOTS_PER_WORKER = 3  # ranks in flight per worker: one being read, the others waiting


@dataclass(frozen=True)
class Parcel:
    """A pickled object whose array buffers wait in shared slot ``slot`` at ``spans``."""

    data: bytes
    slot: int
    spans: tuple[tuple[int, int], ...]


class Slots:
    """A ring of fixed-size slots in an anonymous shared mapping: created before the pool
    forks its workers, which inherit it."""

    def __init__(self, count: int, size: int | None = None) -> None:
        self.count, self.size = count, SLOT_BYTES if size is None else size
        self.mem = mmap.mmap(-1, count * self.size)  # MAP_SHARED | MAP_ANONYMOUS: pages on first touch

    def close(self) -> None:
        self.mem.close()

    def pack(self, obj: Any, slot: int) -> Parcel | Any:
        """``obj`` pickled with its arrays written to ``slot`` (in a worker); ``obj`` itself,
        for the pipe, when its arrays do not fit or one is not contiguous."""
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        spans: list[tuple[int, int]] = []
        offset, base = 0, slot * self.size
        for buf in buffers:
            try:
                raw = buf.raw()
            except BufferError:  # not contiguous
                return obj
            offset += -offset % ALIGN
            if offset + raw.nbytes > self.size:
                return obj
            self.mem[base + offset : base + offset + raw.nbytes] = raw
            spans.append((offset, raw.nbytes))
            offset += raw.nbytes
        return Parcel(data, slot, tuple(spans))

    def unpack(self, parcel: Parcel) -> Any:
        """The object a worker packed, its arrays copied out of the slot (which is free again)."""
        base = parcel.slot * self.size
        buffers = []
        for offset, n in parcel.spans:
            own = np.empty(n, np.uint8)
            own[:] = np.frombuffer(self.mem, np.uint8, n, base + offset)
            buffers.append(own)
        return pickle.loads(parcel.data, buffers=buffers)
