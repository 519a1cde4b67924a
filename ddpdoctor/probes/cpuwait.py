"""How long the training thread has waited for a CPU: the kernel's run-queue delay.

A rank that is late because the host has more runnable threads than cores (ranks, intra-op
threads, a data loader, another job) looks like a straggler to the clocks alone; its run-queue
delay says it was ready and not running. ``/proc/thread-self/schedstat`` holds, for the
calling thread, ``<ns on CPU> <ns waiting on a run queue> <timeslices>``; one ``pread`` of an
open descriptor, read once per step (at the end of backward). The C module's read
(``_fast_step.c``) is used where it is built: in a step's context this Python took about 12 µs.
"""

from __future__ import annotations

import os
import threading

from ddpdoctor.probes import fastpath

_PATH = "/proc/thread-self/schedstat"
# Each thread's own descriptor (the training thread's, in practice): per thread, not per
# ident, since a new thread may get a dead one's ident, and the descriptor reads its opener.
_local = threading.local()
_opened = 0
_broken = False


def _run_queue_us() -> int:
    """This thread's run-queue delay so far, µs; -1 where the kernel does not say (never raises)."""
    global _broken, _opened
    if _broken:
        return -1
    try:
        fd = getattr(_local, "fd", None)
        if fd is None:
            if _opened >= 8:  # a new thread each step would leak descriptors: stop asking
                _broken = True
                return -1
            fd = _local.fd = os.open(_PATH, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            _opened += 1
        return int(os.pread(fd, 64, 0).split()[1]) // 1000
    except (OSError, ValueError, IndexError):
        _broken = True  # no procfs, no schedstats: the field stays -1 and analysis does without
        return -1


_fast = fastpath.module()
run_queue_us = _fast.run_queue_us if _fast is not None else _run_queue_us
