"""Where a run's files go: one directory per run, never world-writable, and every file's name.

``RunDir`` is the one place that spells the run directory's layout; probes, the supervisor,
the reader and the commands all ask it for paths instead of writing names themselves.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PARENT = "ddpdoctor-runs"


@dataclass(frozen=True)
class RunDir:
    """The files of one run directory (one per node of a job)."""

    path: Path

    RUN_META = "run.json"  # the supervisor: command, hosts, exit code (launch.py)
    INTERRUPTED_HUNG = "interrupted_hung_ns"  # run.json: when a Ctrl-C made ddpdoctor end the hung ranks
    # run.json: when a Ctrl-C made ddpdoctor stop a launcher whose ranks had all exited cleanly
    # (torchrun's exit barrier, waiting for a node that failed: supervisor/lingering.py)
    STOPPED_LINGERING = "stopped_lingering_ns"
    WATCH = "watch.json"  # the supervisor's hang watch: hangs, rank exits and errors (watch.py)
    WAITING = "waiting.json"  # while ranks wait on a busy rank: who, on whom, where (waits.py)
    PROFILE = "profile.json"  # a live straggler and a peer, sampled side by side (profile.py)
    ERROR_LOG = "probe-errors.log"  # probes that switched themselves off, and why
    REPORT = "report.html"
    EXPORT = "trace.json"  # Perfetto / Chrome trace
    HANG_SUMMARY = "summary.json"  # inside each hang-N/
    ENDS = "ends.json"  # the supervisor: how each rank ended, its last stderr lines (ends.py)
    STARTUP_ERRORS = "startup-errors.jsonl"  # ranks that failed before their process group (startup.py)
    FR_REQUEST = "fr-request.json"  # the supervisor asks every rank for its Flight Recorder entries
    ATTACH = "attach.json"  # `ddpdoctor attach`: the looks and the verdict (live/attach_run.py)
    ATTACH_TEXT = "attach.txt"  # and what it printed

    # Binary traces (``.bin``); ``.jsonl``: recorded by a version before 3, or an export.
    _TRACE = re.compile(r"^trace-rank(\d+)(?:-attempt(\d+))?\.(?:bin|jsonl)$")
    _PROC = re.compile(r"^proc-rank(\d+)(?:-attempt(\d+))?\.json$")
    _STATUS = re.compile(r"^status-rank(\d+)\.json$")
    _FLIGHT = re.compile(r"^fr-rank(\d+)\.json$")
    _GPU = re.compile(r"^gpu-(.+)\.jsonl$")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "path", Path(path))

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @staticmethod
    def trace_name(rank: int, restart: int = 0) -> str:
        """One trace per rank and elastic restart attempt, so attempts never interleave."""
        return f"trace-rank{rank}-attempt{restart}.bin" if restart else f"trace-rank{rank}.bin"

    def trace(self, rank: int, restart: int = 0) -> Path:
        return self.path / self.trace_name(rank, restart)

    @staticmethod
    def proc_name(rank: int, restart: int = 0) -> str:
        """A rank's process record, written at its start, before init_process_group
        (probes/early.py): what is known of a rank that never became one."""
        return f"proc-rank{rank}-attempt{restart}.json" if restart else f"proc-rank{rank}.json"

    def proc(self, rank: int, restart: int = 0) -> Path:
        return self.path / self.proc_name(rank, restart)

    def procs(self) -> dict[int, Path]:
        """The newest attempt's process record of each rank."""
        return self._newest("proc-rank*.json", self._PROC)

    def _newest(self, pattern: str, name: re.Pattern[str]) -> dict[int, Path]:
        """Per rank, the file of its newest attempt (rank and attempt from ``name``'s groups);
        regular files only."""
        best: dict[int, tuple[int, Path]] = {}
        for path in self.path.glob(pattern):
            match = name.match(path.name)
            if not match or not path.is_file():
                continue
            rank, attempt = int(match.group(1)), int(match.group(2) or 0)
            if rank not in best or attempt > best[rank][0]:
                best[rank] = (attempt, path)
        return {rank: path for rank, (_, path) in sorted(best.items())}

    def status(self, rank: int) -> Path:
        """Rewritten by the rank's writer thread after every flush (probes/liveness.py)."""
        return self.path / f"status-rank{rank}.json"

    def stacks(self, rank: int) -> Path:
        """The rank's faulthandler dump on SIGUSR1 (a stack without ptrace)."""
        return self.path / f"stacks-rank{rank}.txt"

    def last_words(self, kind: str, rank: int) -> Path:
        """What a rank leaves about its end (probes/lastwords.py): ``fatal``/``sigterm``
        (faulthandler's dumps), ``stderr`` (its last stderr bytes), ``exit`` (os._exit's code),
        ``stderr-open`` (exists while its stderr tee may still write)."""
        if kind == "exit":
            return self.path / f"exit-rank{rank}.json"
        if kind == "stderr-open":
            return self.path / f"stderr-rank{rank}.open"
        return self.path / f"{kind}-rank{rank}.txt"

    def holds_run(self) -> bool:
        """Has a run already written here? Another run's files would mix with its own, and a
        diagnosis would read both: a succeeding job reported with the last one's error. A
        directory we cannot read is not known to hold one: making the run there says why."""
        try:
            return os.path.exists(self.path / self.RUN_META) or bool(self.all_traces() or self.procs())
        except OSError:
            return False

    def all_traces(self) -> list[Path]:
        """Every attempt's trace file that is a regular file."""
        return sorted(p for p in self.path.glob("trace-rank*") if self._TRACE.match(p.name) and p.is_file())

    def gpu(self, host: str) -> Path:
        """One node's NVML samples; the host name reduced to characters safe in a file name."""
        return self.path / f"gpu-{re.sub(r'[^A-Za-z0-9._-]', '_', host) or 'host'}.jsonl"

    def hang(self, n: int) -> Path:
        """The n-th hang's directory: summary.json and stack-rank{R}.txt."""
        return self.path / f"hang-{n}"

    def hang_stack(self, n: int, rank: int) -> Path:
        return self.hang(n) / f"stack-rank{rank}.txt"

    @staticmethod
    def flight_dump_name(rank: int) -> str:
        """A rank's Flight Recorder entries, written into a hang's directory on request."""
        return f"fr-rank{rank}.json"

    @classmethod
    def flight_dumps(cls, hang_dir: Path) -> dict[int, Path]:
        found = (cls._FLIGHT.match(p.name) for p in hang_dir.glob("fr-rank*.json"))
        return {int(m.group(1)): hang_dir / m.group(0) for m in found if m}

    @classmethod
    def gpu_host(cls, path: Path) -> str:
        """The (file-name-safe) host of a ``gpu-<host>.jsonl``."""
        match = cls._GPU.match(path.name)
        return match.group(1) if match else path.stem

    def traces(self) -> dict[int, Path]:
        """The newest attempt's trace of each rank (regular files only: a trace name pointing
        at a device such as /dev/full or a FIFO would never end)."""
        return self._newest("trace-rank*", self._TRACE)

    def statuses(self) -> Iterator[tuple[int, Path]]:
        for path in self.path.glob("status-rank*.json"):
            match = self._STATUS.match(path.name)
            if match:
                yield int(match.group(1)), path

    def gpu_files(self) -> list[Path]:
        return sorted(self.path.glob("gpu-*.jsonl"))

    def hang_summaries(self) -> list[Path]:
        """hang-1/summary.json, hang-2/..., in order (hang-10 after hang-9)."""
        found = self.path.glob(f"hang-*/{self.HANG_SUMMARY}")
        return sorted(found, key=lambda p: (len(p.parent.name), p.parent.name))


def new_run_dir(out: str | os.PathLike[str] | None) -> Path:
    """Create the run directory: ``out`` itself, or ``./ddpdoctor-runs/<timestamp>[-N]``."""
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
    else:
        parent = Path(DEFAULT_PARENT)
        parent.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for n in range(1000):
            path = parent / (stamp if n == 0 else f"{stamp}-{n}")
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"too many runs named {parent / stamp}*")
    mode = path.stat().st_mode
    if mode & 0o002:  # honour the umask, but never leave a run dir world-writable
        path.chmod(mode & ~0o002 & 0o7777)
    return path


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename,
    so a reader (or a crash) never sees half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
