"""Large numpy reductions on both cores: the analysis runs in one process, and once the reader's
workers are done the other core idles. A median of 10 million values (a partition) or a gather
from a 40 MB table releases the GIL, so two of them run at once in threads; each item's result
is what it would be alone, returned in order. Only for work that spends its time inside such
calls: Python-level work would only take turns on the GIL."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def map_threads(func: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[func(x) for x in items]``, two or more at a time where there are cores for it."""
    workers = min(len(items), cores())
    if workers < 2:
        return [func(x) for x in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(func, items))
