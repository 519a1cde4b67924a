"""Where a run's files go: one directory per run, never world-writable."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

DEFAULT_PARENT = "ddpdoctor-runs"


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
