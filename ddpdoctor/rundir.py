"""Where a run's files go: one directory per run, never world-writable."""

from __future__ import annotations

import os
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
