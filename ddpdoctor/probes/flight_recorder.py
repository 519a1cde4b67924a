"""PyTorch's Flight Recorder in the ranks: switched on, and dumped on the supervisor's request.

The Flight Recorder keeps, per rank, a ring of the last collectives with their op, sizes,
sequence number and state (on NCCL, with timing on, when each started and completed on the
device). It reads ``TORCH_FR_BUFFER_SIZE`` when the process group is created, so the
supervisor puts it in the job's environment (``environment``); a user's own setting wins.

When the supervisor declares a hang it writes ``fr-request.json`` ({"id", "dir"}) into the run
directory (``request_dumps``); a thread in each rank polls for it and writes the rank's entries
(``torch._C._distributed_c10d._dump_fr_trace_json``) as ``<dir>/fr-rank{R}.json``. The thread
is not the training thread, which is typically blocked inside the collective that hangs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from ddpdoctor.rundir import RunDir

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
BUFFER_SIZE = "2000"  # entries kept per rank: small (a few hundred bytes each)
NCCL_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"  # NCCL: CUDA events per collective (start, end)
POLL_S = 0.25
PROBE = "flight_recorder"


def environment(env: dict[str, str]) -> dict[str, str]:
    """Turn the Flight Recorder on in ``env`` unless the user set it (0 included)."""
    env.setdefault(BUFFER_ENV, BUFFER_SIZE)
    env.setdefault(NCCL_TIMING_ENV, "1")  # read by ProcessGroupNCCL only; gloo ignores it
    return env


def enabled() -> bool:
    try:
        return int(os.environ.get(BUFFER_ENV, "0") or 0) > 0
    except ValueError:
        return False


def dump_json() -> bytes:
    """This rank's Flight Recorder entries, as torch writes them (JSON)."""
    import torch

    return bytes(torch._C._distributed_c10d._dump_fr_trace_json(True, False))


class _Watcher:
    """The rank's polling thread: one stat() per interval, a dump per new request id."""

    def __init__(self, run_dir: str, rank: int, on_error: Any) -> None:
        self.run_dir, self.rank, self.on_error = run_dir, rank, on_error
        self.request = str(RunDir(run_dir) / RunDir.FR_REQUEST)
        self.done: set[int] = set()
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._run, name="ddpdoctor-fr", daemon=True)

    def _run(self) -> None:
        mtime = 0
        while os.getpid() == self.pid:
            time.sleep(POLL_S)
            try:
                st = os.stat(self.request)
            except OSError:
                continue
            if st.st_mtime_ns == mtime:
                continue
            mtime = st.st_mtime_ns
            try:
                self.serve()
            except Exception as exc:
                self.on_error(exc)
                return

    def serve(self) -> Path | None:
        """Answer the current request if it is new; returns the file written."""
        try:
            req = json.loads(Path(self.request).read_text(encoding="utf-8"))
            n, sub = int(req["id"]), str(req["dir"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # half-written or foreign: read again at the next change
        if n in self.done or os.sep in sub or sub.startswith("."):
            return None
        self.done.add(n)
        out = Path(self.run_dir) / sub / RunDir.flight_dump_name(self.rank)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_bytes(dump_json())
        os.replace(tmp, out)
        return out


def install(collector: Any) -> None:
    """Start the rank's dump thread when the Flight Recorder is on (never raises)."""
    if not enabled():
        return
    try:
        w = _Watcher(collector.run_dir, collector.rank, lambda exc: collector.fail(PROBE, exc))
        w.thread.start()
    except Exception as exc:
        collector.fail(PROBE, exc)


def request_dumps(run_dir: Path, hang_dir: Path, ranks: list[int], timeout_s: float = 5.0) -> dict[int, Path]:
    """Supervisor side: ask every rank for its entries into ``hang_dir``; wait up to
    ``timeout_s`` for ``ranks``' files. Returns the files that arrived, by rank."""
    n = int(hang_dir.name.rsplit("-", 1)[-1]) if hang_dir.name.rsplit("-", 1)[-1].isdigit() else 1
    tmp = run_dir / f".{RunDir.FR_REQUEST}.tmp"
    tmp.write_text(json.dumps({"id": n, "dir": hang_dir.name}), encoding="utf-8")
    os.replace(tmp, run_dir / RunDir.FR_REQUEST)
    deadline = time.monotonic() + timeout_s
    found: dict[int, Path] = {}
    while True:
        for r in ranks:
            path = hang_dir / RunDir.flight_dump_name(r)
            if r not in found and path.exists():
                found[r] = path
        if len(found) == len(ranks) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)
