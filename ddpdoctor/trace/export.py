"""Rank traces as JSON lines: the export for people who grep traces (``ddpdoctor export``).

Each rank's binary trace becomes ``trace-rank{R}.jsonl`` in the version-2 line format
(``[kind, ts_us, dur_us, step, *fields]``, header first, then by time), which ``diagnose`` and
``report`` also read; a trace that is JSON lines already is copied as it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import binfmt

_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str).encode


def export_jsonl(run_dir: Path, out: Path) -> list[Path]:
    """Write every trace of ``run_dir`` (every attempt) into ``out`` as JSON lines."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in RunDir(run_dir).all_traces():
        target = out / (path.stem + ".jsonl")
        data = path.read_bytes()
        if binfmt.is_binary(data):
            lines = "".join(_ENCODE(r) + "\n" for r in binfmt.records(binfmt.decode(data)))
            target.write_text(lines, encoding="utf-8")
        elif path.resolve() != target.resolve():
            shutil.copyfile(path, target)
        written.append(target)
    return written
