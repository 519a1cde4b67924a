"""`ddpdoctor attach PID`: diagnose a job that was started without ddpdoctor, from its stacks.

No probe ran in the job, so what the run-time watcher reads from status files (which sync
point each rank is in) is read here from each rank's Python stack instead: py-spy dumps every
thread of every rank on this node, and the frames of torch's own collectives, DDP's buffer
broadcast, the autograd engine and the DataLoader name the sync point. The verdict is then the
watcher's own (analysis/hung/hang.py ``analyse``), so both say the same words for the same hang.

One look cannot tell a hang from a slow step, so attach looks several times over ``watch_s``:
a rank whose stack changed between looks is progressing, and so is one blocked at every look
whose main thread still ran between them (a loop of short steps whose sleep every look found);
one whose stack stayed the same is stuck there (busy if its CPU time advanced: slow work or an
endless loop; idle if it waits).
The run directory it writes (header-only traces, the stacks, ``hang-1/summary.json`` in the
watcher's format when stuck) is one `diagnose` and `report` read like any other.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ddpdoctor.analysis.hung.hang import main_thread, main_thread_of
from ddpdoctor.live.procs import RankProc
from ddpdoctor.supervisor.stacks import pyspy_path
from ddpdoctor.trace.livephase import LivePhase
from ddpdoctor.trace.stacktext import parse_pyspy_json

ATTACH_SCHEMA = "ddpdoctor.attach/1"
NO_PYSPY = "py-spy not found (pip install py-spy; DDPDOCTOR_PYSPY names another), or DDPDOCTOR_PYSPY=off"
PYSPY_TIMEOUT_S = 10.0
NATIVE_TIMEOUT_S = 20.0
BUSY_CPU_SHARE = 0.5  # of one core between looks: the rank is computing, not waiting
_C10D = "torch/distributed/distributed_c10d.py"
_DDP = "torch/nn/parallel/distributed.py"
_BROADCAST = {
    "_sync_buffers",
    "_sync_module_buffers",
    "_default_broadcast_coalesced",
    "_distributed_broadcast_coalesced",
    "_sync_params_and_buffers",
}
_NOT_BLOCKING = {"get_rank", "get_world_size", "is_initialized", "get_backend", "is_available"}
_REFUSED = re.compile(r"permission denied|operation not permitted|EPERM|ptrace", re.IGNORECASE)


class AttachError(Exception):
    """Attach cannot start (no such process, no ranks, no ptrace rights): one line for the user."""


def pyspy(pid: int, native: bool = False) -> dict[str, Any]:
    """One dump in stacks.py's shape, plus each thread's ``active`` flag; native frames as text."""
    exe = pyspy_path()
    if exe is None:
        return {
            "method": None,
            "threads": [],
            "error": "py-spy not found (pip install py-spy), or DDPDOCTOR_PYSPY=off",
        }
    args = [exe, "dump", "--pid", str(pid)] + (["--native"] if native else ["--json"])
    try:
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=NATIVE_TIMEOUT_S if native else PYSPY_TIMEOUT_S
        )
    except (subprocess.TimeoutExpired, OSError) as exc:
        return {"method": None, "threads": [], "error": f"py-spy: {exc}"}
    if proc.returncode != 0:
        return {"method": None, "threads": [], "error": f"py-spy: {proc.stderr.strip()[-300:]}"}
    if native:
        return {"method": "py-spy --native", "threads": [], "error": "", "text": proc.stdout}
    return parse_pyspy_json(proc.stdout)


def phase_of(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The sync point a main-thread stack (innermost first) is in, as the probes would name it."""
    named = [(str(f.get("file") or ""), str(f.get("function") or "").rsplit(".", 1)[-1]) for f in frames]
    for file, fn in reversed(named):  # the outermost torch call is the one the user made
        if file.endswith(_DDP) and fn == "__init__":  # its shape check and state broadcast
            return {"name": "ddp_init", "op": "init"}
        if file.endswith(_DDP) and fn in _BROADCAST:
            return LivePhase.SYNC_BUFFERS.status()
        if file.endswith(_C10D) and not fn.startswith("_") and fn not in _NOT_BLOCKING:
            return {**LivePhase.COLLECTIVE.status(), "op": fn}
    for file, fn in named:
        if (file.endswith("torch/autograd/__init__.py") and fn == "backward") or fn == "_engine_run_backward":
            return LivePhase.BACKWARD.status()
        if file.endswith("torch/utils/data/dataloader.py") and fn == "__next__":
            return LivePhase.DATA.status()
    return None


def _main_cpu_s(pid: int) -> float | None:
    """The main thread's CPU seconds, to the nanosecond (schedstat), else to the clock tick."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat", encoding="ascii") as fh:
            return int(fh.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return _cpu_s(pid, f"/proc/{pid}/task/{pid}/stat")


def _cpu_s(pid: int, path: str = "") -> float | None:
    """The process's CPU seconds (from ``path``, a thread's stat, where given)."""
    try:
        with open(path or f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _key(dump: dict[str, Any]) -> tuple:
    return tuple((f.get("file"), f.get("line"), f.get("function")) for f in main_thread(dump["threads"]))


@dataclass
class RankLooks:
    proc: RankProc
    dumps: list[dict[str, Any]] = field(default_factory=list)
    cpu: list[tuple[float, float | None]] = field(default_factory=list)  # (monotonic, cpu s)
    main_cpu: list[tuple[float, float | None]] = field(default_factory=list)  # its main thread's
    native: str = ""

    @property
    def last(self) -> dict[str, Any]:
        ok = [d for d in self.dumps if d["method"]]
        return ok[-1] if ok else (self.dumps[-1] if self.dumps else {"method": None, "threads": []})

    @property
    def moved(self) -> bool:
        """Its stack changed between looks; or its main thread was blocked (a sleep, a wait) at
        each look and still ran between them: it left the wait and came back, as a loop of short
        steps does when every look finds it in its sleep. A thread blocked in one wait all along
        runs nothing; one spinning at a line (a busy loop, a spin-wait) is active, not blocked."""
        ok = [d for d in self.dumps if d["method"]]
        if len({_key(d) for d in ok}) > 1:
            return True
        blocked = bool(ok) and not any(_main_active(d) for d in ok)
        ran = _share(self.main_cpu)
        return blocked and ran is not None and ran >= RAN_CPU_SHARE

    @property
    def cpu_share(self) -> float | None:
        return _share(self.cpu)


# Of a core, by a main thread blocked at every look: it ran between them. A thread blocked in
# one wait all along uses microseconds (each look's ptrace stop and resume); a loop that sleeps
# 100 ms a step used 3 % here.
RAN_CPU_SHARE = 0.005


def _share(samples: list[tuple[float, float | None]]) -> float | None:
    """CPU seconds per second between the first and the last sample."""
    known = [(t, c) for t, c in samples if c is not None]
    if len(known) < 2 or known[-1][0] <= known[0][0]:
        return None
    return (known[-1][1] - known[0][1]) / (known[-1][0] - known[0][0])


def _main_active(dump: dict[str, Any]) -> bool:
    """py-spy's word that the main thread was running (not blocked in a sleep or a wait)."""
    return bool(main_thread_of(dump.get("threads") or []).get("active", True))


LOOK_EVERY_S = 0.5


def look(ranks: list[RankProc], watch_s: float, every_s: float = LOOK_EVERY_S) -> dict[int, RankLooks]:
    """Dump every rank every ``every_s`` over ``watch_s`` seconds (once when ``watch_s`` is 0):
    a rank that spends most of its step at one line (a sleep, a long kernel launch, a wait for
    a straggler) still shows another line in one of several looks."""
    out = {r.rank: RankLooks(r) for r in ranks}
    n = 1 if watch_s <= 0 else max(2, int(watch_s / every_s) + 1)
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(16, len(ranks))) as pool:
        for i in range(n):
            if i:
                time.sleep(max(0.0, start + watch_s * i / (n - 1) - time.monotonic()))
            for r in ranks:
                out[r.rank].cpu.append((time.monotonic(), _cpu_s(r.pid)))
                out[r.rank].main_cpu.append((time.monotonic(), _main_cpu_s(r.pid)))
            for rank, dump in zip(out, pool.map(lambda r: pyspy(r.pid), ranks)):
                out[rank].dumps.append(dump)
    return out


def refused(results: dict[int, RankLooks]) -> str:
    """The kernel's refusal, if every dump was refused."""
    errors = [d.get("error", "") for r in results.values() for d in r.dumps]
    if errors and all(e and _REFUSED.search(e) for e in errors):
        return errors[0]
    return ""
