"""Launch a job with the bootstrap in its environment, forward signals, keep its exit code.

The job runs in its own process group. When ddpdoctor owns the terminal, that group is made
the foreground one, so Ctrl-C reaches the job exactly as it would without us; otherwise
SIGINT is forwarded to the job's group (as a terminal would) and SIGTERM/SIGHUP to the
launcher itself (torchrun passes them on to its workers).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ddpdoctor
from ddpdoctor import _env
from ddpdoctor.probes import flight_recorder
from ddpdoctor.rundir import RunDir, write_atomic
from ddpdoctor.supervisor.activity import pid_alive
from ddpdoctor.supervisor.layout import Layout, parse_layout

BOOTSTRAP_DIR = Path(__file__).resolve().parent.parent / "bootstrap"
RUN_SCHEMA = "ddpdoctor.run/1"
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


EXIT_HANG_KILLED = 124  # `--on-hang kill` stopped a hung job (as timeout(1) exits)


@dataclass
class JobResult:
    exit_code: int
    signal: int | None = None  # the signal that killed the launcher, if any
    interrupted_by: list[str] = field(default_factory=list)  # signals we forwarded
    hangs: int = 0  # hangs caught by the watcher (supervisor/watch.py)
    killed_on_hang: bool = False  # --on-hang kill stopped the job


@dataclass
class WatchOptions:
    """How `run_job` watches for hangs (see supervisor/watch.py)."""

    hang_timeout: float | None = None  # None: adaptive
    on_hang: str = "dump"  # "dump" | "kill"
    floor_s: float | None = None  # None: statuses.hang_floor_s()


def job_environment(run_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The job's environment: ours plus the bootstrap first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    path = env.get("PYTHONPATH", "")
    parts = [str(BOOTSTRAP_DIR)] + [p for p in path.split(os.pathsep) if p and p != str(BOOTSTRAP_DIR)]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env[_env.RUN_DIR] = str(run_dir.resolve())
    env[_env.BOOTSTRAP_DIR] = str(BOOTSTRAP_DIR)
    return flight_recorder.environment(env)  # before init_process_group reads it


def write_meta(run_dir: Path, meta: dict[str, Any]) -> None:
    """Write run.json atomically (temporary name, then rename)."""
    write_atomic(run_dir / RunDir.RUN_META, json.dumps(meta, indent=2))


def run_job(
    command: list[str], run_dir: Path, watch: WatchOptions | None = None, nvml_interval: float | None = None
) -> JobResult:
    """Run ``command`` to completion under the doctor; returns its exit code (128+N if killed).
    ``nvml_interval``: seconds between GPU samples (supervisor/nvml.py), None for none."""
    meta: dict[str, Any] = {
        "schema": RUN_SCHEMA,
        "command": command,
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "ddpdoctor": ddpdoctor.__version__,
        "started_ns": time.time_ns(),
        "status": "running",
    }
    layout = parse_layout(command, dict(os.environ))
    meta["job"] = layout.to_json()  # where `top` finds the job's store while it runs
    write_meta(run_dir, meta)
    sampler = _start_sampler(run_dir, nvml_interval)
    try:
        proc = subprocess.Popen(command, env=job_environment(run_dir), process_group=0)
    except OSError as exc:
        meta.update(status="failed to start", error=str(exc), exit_code=127, ended_ns=time.time_ns())
        write_meta(run_dir, meta)
        if sampler is not None:
            sampler.stop()
        raise
    meta["pid"] = proc.pid
    write_meta(run_dir, meta)
    result = JobResult(exit_code=0)
    terminal = _ForegroundTerminal(proc.pid)
    watcher = _start_watcher(run_dir, proc.pid, watch, layout)
    previous = {sig: signal.getsignal(sig) for sig in _FORWARDED}

    def forward(signum: int, frame: Any) -> None:
        result.interrupted_by.append(signal.Signals(signum).name)
        if signum == signal.SIGINT and watcher is not None and watcher.hung:
            # Ranks blocked in a collective only act on SIGINT once it returns: end them now.
            meta.setdefault(RunDir.INTERRUPTED_HUNG, time.time_ns())  # the user's Ctrl-C ended them
            threading.Thread(target=watcher.kill_job, args=(watcher.rank_pids(),), daemon=True).start()
        elif signum == signal.SIGINT and watcher is not None and watcher.lingering:
            # Its ranks are gone and torchrun waits in its exit barrier, where it acts on SIGINT
            # only when the store's wait returns: stop the launcher (no rank pid to reuse).
            meta.setdefault(RunDir.STOPPED_LINGERING, time.time_ns())
            threading.Thread(target=watcher.kill_job, args=([],), daemon=True).start()
        try:
            if signum == signal.SIGINT:
                os.killpg(proc.pid, signum)
            else:
                os.kill(proc.pid, signum)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    try:
        terminal.give()
        while True:
            try:
                code = proc.wait()
                break
            except InterruptedError:
                continue
    finally:
        terminal.take_back()
        if watcher is not None:
            watcher.stop()
            result.hangs, result.killed_on_hang = len(watcher.hangs), watcher.killed
            meta["job"] = watcher.job_layout()
        if sampler is not None:
            sampler.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    write_meta(run_dir, meta)  # settle reads whether the user interrupted a hung job
    _settle(run_dir)
    if code < 0:
        result.signal = -code
        code = 128 - code
    result.exit_code = code
    meta.update(
        status="finished",
        # What `ddpdoctor run` itself exits with, so the summary and the shell agree; the job's
        # own code stays beside it.
        exit_code=EXIT_HANG_KILLED if result.killed_on_hang else code,
        job_exit_code=code,
        killed_by_signal=result.signal,
        signals_forwarded=result.interrupted_by,
        hangs=result.hangs,
        killed_on_hang=result.killed_on_hang,
        ended_ns=time.time_ns(),
    )
    write_meta(run_dir, meta)
    return result


def _start_watcher(run_dir: Path, launcher_pid: int, watch: WatchOptions | None, layout: Layout) -> Any:
    """Start the hang watcher, sharing with the other nodes' watchers through the job's own
    rendezvous store when the launcher says the job spans nodes; a failure here costs the
    watching, never the job."""
    if watch is None:
        return None
    try:
        from ddpdoctor.supervisor.board import Board
        from ddpdoctor.supervisor.statuses import hang_floor_s
        from ddpdoctor.supervisor.watch import Watcher

        watcher = Watcher(
            run_dir,
            hang_timeout=watch.hang_timeout,
            on_hang=watch.on_hang,
            floor_s=watch.floor_s if watch.floor_s is not None else hang_floor_s(),
            report=eprint,
            kill_job=lambda pids: stop_job(launcher_pid, pids),
            board=Board(layout, report=eprint),
        )
        watcher.start()
        return watcher
    except Exception as exc:
        eprint(f"ddpdoctor: hang watch not started: {exc!r}")
        return None


def _settle(run_dir: Path) -> None:
    """Complete the traces of ranks that died between flushes, and note how each rank ended."""
    try:
        from ddpdoctor.supervisor.ends import settle

        settle(run_dir)
    except Exception as exc:
        eprint(f"ddpdoctor: could not complete the traces after the job: {exc!r}")


def stop_job(launcher_pid: int, rank_pids: list[int], grace_s: float = 5.0) -> None:
    """Stop a hung job: ranks blocked in a collective ignore SIGTERM until it returns, so they
    get SIGKILL (their traces are flushed continuously and their stacks are already taken);
    the launcher then sees its workers fail and exits; if not, SIGTERM, then SIGKILL its group."""
    for pid in rank_pids:
        if pid > 0:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            with contextlib.suppress(OSError):
                if sig == signal.SIGKILL:
                    os.killpg(launcher_pid, sig)
                else:
                    os.kill(launcher_pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not pid_alive(launcher_pid):
                return
            time.sleep(0.1)


def _start_sampler(run_dir: Path, interval: float | None) -> Any:
    """Start the per-node NVML sampler; any failure costs the GPU metrics, never the job."""
    if interval is None:
        return None
    try:
        from ddpdoctor.supervisor.nvml import start_sampler

        return start_sampler(run_dir, interval)
    except Exception:
        return None


class _ForegroundTerminal:
    """Hand the controlling terminal to the job's process group while it runs, then take it back."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.fd: int | None = None
        try:
            if os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp():
                self.fd = 0
        except OSError:
            self.fd = None

    def give(self) -> None:
        self._set(self.pgid)

    def take_back(self) -> None:
        self._set(os.getpgrp())

    def _set(self, pgid: int) -> None:
        if self.fd is None:
            return
        old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            os.tcsetpgrp(self.fd, pgid)
        except OSError:
            pass
        finally:
            signal.signal(signal.SIGTTOU, old)


def banner(run_dir: Path) -> str:
    return f"ddpdoctor {ddpdoctor.__version__}: recording every rank's sync points to {run_dir}"


def eprint(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
