"""`diagnose --json`: one JSON object, schema ``ddpdoctor.diagnosis/1``."""

from __future__ import annotations

import json
from typing import Any

from ddpdoctor.analysis import Diagnosis
from ddpdoctor.analysis.slow import gpu as _gpu

SCHEMA = "ddpdoctor.diagnosis/1"


def document(diag: Diagnosis) -> dict[str, Any]:
    run = diag.run
    return {
        "schema": SCHEMA,
        "run": {
            "world_size": run.world_size,
            "ranks": sorted(run.ranks),
            "hosts": run.hosts,
            "exit_code": run.exit_code,
            "command": run.command,
            "run_dirs": [str(d) for d in run.dirs],
            "backend": _header_value(diag, "backend"),
            "framework": diag.framework,
            "torch": _header_value(diag, "torch"),
            "steps": {str(r): n for r, n in diag.steps.items()},
            "step_time_s": {str(r): v for r, v in diag.step_time_s.items()},
            "batch_size": diag.batch_size,
            "ddp": diag.ddp,
            "ddp_models": [{k: v for k, v in m.items() if k != "param_names"} for m in diag.ddp_models],
            "notes": run.notes + diag.notes,
        },
        "phases": {str(r): p for r, p in diag.phases.items()},
        "buckets": diag.buckets,
        "findings": [f.to_json() for f in diag.findings],
        "gpus": _gpu.summary(diag.gpus),
        # a hung or failed run drawn where it happened (analysis/failed/failure.py); null otherwise
        "failure": diag.failure.to_json() if diag.failure is not None else None,
    }


def _header_value(diag: Diagnosis, key: str) -> Any:
    for _, trace in sorted(diag.run.ranks.items()):
        if key in trace.header:
            return trace.header[key]
    return None


def render(diag: Diagnosis) -> str:
    """The diagnosis as indented JSON text."""
    return json.dumps(document(diag), indent=2)


def error(message: str, run_dirs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """What `diagnose --json` prints when nothing can be read: still one JSON object."""
    return {
        "schema": SCHEMA,
        "error": message,
        "run": {"run_dirs": [str(d) for d in run_dirs]},
        "findings": [],
    }
