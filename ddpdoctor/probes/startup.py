"""Startup failures in one line: port in use, rendezvous timeout, world-size mismatch, backend.

Installed in every process of the job (torchrun's agent too: a port clash fails there, not in a
rank). An uncaught exception raised before the process became a rank is matched against known
messages; a match is appended to ``startup-errors.jsonl`` in the run directory, where
`ddpdoctor run` finds it and prints the one-line explanation. Python's own traceback is printed
as before: the hook only adds a record.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from typing import Any

from ddpdoctor import _env
from ddpdoctor.rundir import RunDir

_PORT = re.compile(r"port:? (\d+)", re.I)
_JOINED = re.compile(r"(\d+)/(\d+) clients joined")
_NO_BACKEND = re.compile(r"doesn't have (\w+) built in")


def classify(exc_type: str, message: str) -> tuple[str, str] | None:
    """(kind, one line for the user) for a known startup failure, else None. Pure."""
    text = f"{exc_type}: {message}"
    low = text.lower()
    if "eaddrinuse" in low or "address already in use" in low:
        m = _PORT.search(text)
        port = f" {m.group(1)}" if m else ""
        return (
            "port_in_use",
            f"master port{port} is already in use (another job, or a leftover one, listens there): "
            "pass a free --master_port, or use torchrun --standalone",
        )
    m = _JOINED.search(text)
    if m:
        joined, expected = m.groups()
        return (
            "world_size_mismatch",
            f"only {joined} of {expected} ranks joined the rendezvous before the timeout: WORLD_SIZE "
            f"({expected}) does not match the processes started, or some ranks failed to start",
        )
    timed_out = "time" in low and "out" in low
    if "rendezvoustimeout" in low.replace(" ", "") or ("rendezvous" in low and timed_out):
        return (
            "rendezvous_timeout",
            "rendezvous timed out: not every node joined (check --nnodes, --rdzv-endpoint / "
            "MASTER_ADDR:MASTER_PORT, and that every node's launcher started and can reach it)",
        )
    m = _NO_BACKEND.search(text)
    if m:
        backend = m.group(1).lower()
        hint = "use backend 'gloo' on CPU" if backend == "nccl" else "pick a backend this build has"
        return "backend_unavailable", f"backend '{backend}' is not built into this torch: {hint}"
    if "processgroupnccl is only supported with gpus" in low or ("nccl" in low and "no gpus" in low):
        return "backend_unavailable", "backend 'nccl' needs GPUs and none is visible: use 'gloo' on CPU"
    if "invalid backend" in low or "unknown backend" in low:
        return "backend_unavailable", f"unknown backend ({message.strip()[:120]})"
    return None


def _record(exc_type: Any, exc: Any) -> None:
    from ddpdoctor.probes import collector

    run_dir = os.environ.get(_env.RUN_DIR)
    if not run_dir or collector.ACTIVE is not None:
        return  # not under ddpdoctor, or already a rank: not a startup failure
    name = getattr(exc_type, "__name__", str(exc_type))
    found = classify(name, str(exc))
    if found is None:
        return
    kind, line = found
    rec = {
        "kind": kind,
        "line": line,
        "type": name,
        "message": str(exc)[:1000],
        "pid": os.getpid(),
        "rank": os.environ.get("RANK"),
        "wall_ns": time.time_ns(),
    }
    with open(RunDir(run_dir) / RunDir.STARTUP_ERRORS, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(rec) + "\n")


def install() -> None:
    previous = sys.excepthook

    def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
        with contextlib.suppress(Exception):
            _record(exc_type, exc)
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook


def read(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The recorded startup failures, earliest first."""
    out: list[dict[str, Any]] = []
    try:
        with open(RunDir(run_dir) / RunDir.STARTUP_ERRORS, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    except OSError:
        return []
    return sorted(out, key=lambda r: r.get("wall_ns", 0))
