"""What a rank process leaves before it becomes a rank: its start, its end, its last words.

The probes record nothing until ``init_process_group``; a rank that fails before it (a missing
config, an import error, a device it cannot open) would leave no file at all, and the ranks that
wait for it at the rendezvous none either. So a process the launcher started as a rank (torchrun
puts ``RANK`` in its environment) writes, at its start:

* ``proc-rank{R}.json``: rank, world size, local rank, restart, pid, argv, start time; rewritten
  at a Python exit with the exit time, the uncaught exception if there was one, and whether the
  process had become a rank (called init_process_group);
* its last words (``probes/lastwords.py``), taken now rather than at init: the stderr tail, the
  stacks on SIGTERM (the launcher stopping it) and on a fatal signal, ``os._exit``'s code.

Processes a rank starts (compile workers, spawned DataLoader workers) inherit ``RANK`` too; the
bootstrap notes in the environment which rank a process was, and a child of that same rank
records nothing. Nothing here imports torch or raises.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import time
from typing import Any

from ddpdoctor import _env
from ddpdoctor.rundir import RunDir, write_atomic

PROC_SCHEMA = "ddpdoctor.proc/1"
PARENT_RANK_ENV = "DDPDOCTOR_PARENT_RANK"  # the RANK of the process that started this one ("": none)


class _Early:
    """What ``lastwords.install`` needs of a collector, before there is one."""

    def __init__(self, run_dir: str, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank

    def fail(self, probe: str, exc: BaseException) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.write(f"ddpdoctor: {probe} not installed before init: {exc!r}\n")


def is_rank_process(environ: Any = os.environ) -> bool:
    """Started by the launcher as a rank: RANK and WORLD_SIZE set (as torchrun sets them; a
    RANK left in a shell alone is not enough), and not by a process that was that rank."""
    rank = environ.get("RANK", "")
    return rank.isdigit() and environ.get("WORLD_SIZE", "").isdigit() and environ.get(PARENT_RANK_ENV) != rank


def install() -> None:
    run_dir = os.environ.get(_env.RUN_DIR)
    mine = is_rank_process()
    os.environ[PARENT_RANK_ENV] = os.environ.get("RANK", "")  # for the processes this one starts
    if not run_dir or not mine:
        return
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    record: dict[str, Any] = {
        "schema": PROC_SCHEMA,
        "rank": rank,
        "world_size": _int(os.environ.get("WORLD_SIZE")),
        "local_rank": _int(os.environ.get("LOCAL_RANK")),
        "restart": restart,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "host": socket.gethostname(),
        "argv": list(sys.argv),
        "started_wall": time.time(),
    }
    path = RunDir(run_dir).proc(rank, restart)
    write_atomic(path, json.dumps(record))
    _watch_exceptions(record)
    atexit.register(_at_exit, path, record)
    from ddpdoctor.probes import lastwords

    lastwords.install(_Early(run_dir, rank))


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def _watch_exceptions(record: dict[str, Any]) -> None:
    previous = sys.excepthook

    def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
        with contextlib.suppress(Exception):
            name = getattr(exc_type, "__name__", str(exc_type))
            record["error"] = {"type": name, "message": str(exc)[:2000], "wall_ns": time.time_ns()}
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook


def _at_exit(path: Any, record: dict[str, Any]) -> None:
    """The process leaves through Python's shutdown: note when, and whether it became a rank."""
    with contextlib.suppress(Exception):
        from ddpdoctor.probes import collector

        record["exit_wall"] = time.time()
        record["initialised"] = collector.INITIALISED  # even where its trace could not be opened
        write_atomic(path, json.dumps(record))
