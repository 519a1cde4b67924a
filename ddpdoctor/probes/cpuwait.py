"""How long the training thread has waited for a CPU: the kernel's run-queue delay.

A rank that is late because the host has more runnable threads than cores (ranks, intra-op
threads, a data loader, another job) looks like a straggler to the clocks alone; its run-queue
delay says it was ready and not running. ``/proc/thread-self/schedstat`` holds, for the
calling thread, ``<ns on CPU> <ns waiting on a run queue> <timeslices>``; one ``pread`` of an
open descriptor costs about a microsecond, read once per step (at the end of backward).
"""

from __future__ import annotations

import os
import threading

_PATH = "/proc/thread-self/schedstat"
_fds: dict[int, int] = {}  # thread ident -> open descriptor (the training thread, in practice)
_broken = False


def run_queue_us() -> int:
    """This thread's run-queue delay so far, µs; -1 where the kernel does not say (never raises)."""
    global _broken
    if _broken:
        return -1
    try:
        ident = threading.get_ident()
        fd = _fds.get(ident)
        if fd is None:
            if len(_fds) >= 8:  # a new thread each step would leak descriptors: stop asking
                _broken = True
                return -1
            fd = _fds[ident] = os.open(_PATH, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return int(os.pread(fd, 64, 0).split()[1]) // 1000
    except (OSError, ValueError, IndexError):
        _broken = True  # no procfs, no schedstats: the field stays -1 and analysis does without
        return -1
