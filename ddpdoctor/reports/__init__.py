"""Reports: renderers of a Diagnosis. Each one knows nothing about the others.

Every renderer module has ``render(diag) -> str``. The formats written to files are named in
``FORMATS`` (with the suffix that selects each), and ``write`` writes any of them atomically.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from ddpdoctor.rundir import write_atomic

# format -> (renderer module, file suffixes that select it, default file name)
FORMATS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "html": ("ddpdoctor.reports.html", (".html", ".htm"), "report.html"),
    "perfetto": ("ddpdoctor.reports.chrome", (".json",), "trace.json"),
    "json": ("ddpdoctor.reports.json_report", (), "diagnosis.json"),
}


def renderer(fmt: str) -> ModuleType:
    return importlib.import_module(FORMATS[fmt][0])


def format_of(path: str | os.PathLike[str]) -> str | None:
    """The format a file name asks for by its suffix (``.json`` is a Perfetto trace)."""
    suffix = Path(path).suffix.lower()
    return next((fmt for fmt, (_, suffixes, _) in FORMATS.items() if suffix in suffixes), None)


def write(diag: Any, path: str | os.PathLike[str], fmt: str | None = None) -> Path:
    """Render ``diag`` in ``fmt`` (by default the one ``path``'s suffix names) to ``path``,
    atomically: a temporary name in the same directory, then a rename."""
    fmt = fmt or format_of(path)
    if fmt not in FORMATS:
        raise ValueError(f"{path}: no format for this suffix; name one of {', '.join(FORMATS)}")
    return write_atomic(path, renderer(fmt).render(diag))
