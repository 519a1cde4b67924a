"""Stacks of live ranks: py-spy first, the rank's own faulthandler as the fallback.

py-spy ``dump --json`` runs once per PID (its ``--subprocesses`` is ignored in JSON mode), all
ranks in parallel, each under a timeout so a wedged py-spy can never stall the supervisor.
When py-spy is missing or refused (no ptrace permission), and only when the rank confirmed in
its status file that SIGUSR1 is registered with faulthandler (the default action would kill
it), the rank is sent SIGUSR1 and writes its own Python stacks.

A dump is ``{"method": "py-spy"|"faulthandler"|None, "threads": [{"name", "frames": [{"file",
"line", "function"}...]}], "error": str}``, frames innermost first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ddpdoctor import _env
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.trace.stacktext import parse_faulthandler, parse_pyspy_json

PYSPY_TIMEOUT_S = 5.0
FAULTHANDLER_WAIT_S = 1.5


def pyspy_path() -> str | None:
    """DDPDOCTOR_PYSPY if set ("off": none), else py-spy from ddpdoctor's own environment (a
    venv that is not activated is not on PATH), else from PATH."""
    chosen = os.environ.get(_env.PYSPY)
    if chosen:
        return None if chosen == "off" else shutil.which(chosen)
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def pyspy_dump(pid: int, timeout: float = PYSPY_TIMEOUT_S, nonblocking: bool = False) -> dict[str, Any]:
    """One py-spy dump; ``nonblocking`` reads the stack without pausing the rank (for the
    repeated samples that tell a busy rank from a stuck one)."""
    exe = pyspy_path()
    if exe is None:
        return {"method": None, "threads": [], "error": "py-spy not found"}
    try:
        proc = subprocess.run(
            [exe, "dump", "--pid", str(pid), "--json"] + (["--nonblocking"] if nonblocking else []),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"method": None, "threads": [], "error": f"py-spy timed out after {timeout:g} s"}
    except OSError as exc:
        return {"method": None, "threads": [], "error": f"py-spy: {exc}"}
    if proc.returncode != 0:
        return {"method": None, "threads": [], "error": f"py-spy: {proc.stderr.strip()[-300:]}"}
    return parse_pyspy_json(proc.stdout)


def faulthandler_dump(pid: int, path: str, wait: float = FAULTHANDLER_WAIT_S) -> dict[str, Any]:
    try:
        offset = os.path.getsize(path)
        os.kill(pid, signal.SIGUSR1)
    except OSError as exc:
        return {"method": None, "threads": [], "error": f"faulthandler: {exc}"}
    deadline = time.monotonic() + wait
    text, size = "", -1
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            new_size = os.path.getsize(path)
        except OSError:
            continue
        if new_size > offset and new_size == size:  # written and no longer growing
            break
        size = new_size
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            fh.seek(offset)
            text = fh.read()
    except OSError as exc:
        return {"method": None, "threads": [], "error": f"faulthandler: {exc}"}
    if not text.strip():
        return {"method": None, "threads": [], "error": "faulthandler wrote nothing"}
    return {"method": "faulthandler", "threads": parse_faulthandler(text), "error": "", "text": text}


def dump_rank(status: RankStatus, use_pyspy: bool = True) -> dict[str, Any]:
    pid = status.pid or 0
    if pid <= 0:
        return {"method": None, "threads": [], "error": "no pid"}
    result = pyspy_dump(pid) if use_pyspy else {"method": None, "threads": [], "error": "py-spy off"}
    if result["method"] is None and status.faulthandler:
        fallback = faulthandler_dump(pid, status.faulthandler)
        fallback["error"] = "; ".join(filter(None, [result["error"], fallback["error"]]))
        result = fallback
    return result


def dump_all(statuses: dict[int, RankStatus], use_pyspy: bool = True) -> dict[int, dict[str, Any]]:
    """Stacks of every rank, dumped in parallel."""
    if not statuses:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(statuses))) as pool:
        futures = {r: pool.submit(dump_rank, s, use_pyspy) for r, s in statuses.items()}
        return {r: f.result() for r, f in futures.items()}


def render_stack(rank: int, dump: dict[str, Any], raw: str) -> str:
    lines = [f"rank {rank}: stack by {dump.get('method') or 'nothing'} {dump.get('error') or ''}".rstrip()]
    for t in dump.get("threads") or []:
        lines.append(f"\nThread {t.get('name')} (most recent call first):")
        for f in t.get("frames") or []:
            lines.append(f'  File "{f.get("file")}", line {f.get("line")}, in {f.get("function")}')
    return "\n".join(lines) + "\n"
