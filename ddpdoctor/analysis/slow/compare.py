"""Two runs side by side: throughput, step-time distribution, phase breakdown, and the findings
that one run has and the other has not, or has only as something milder (a fix that worked, or
a regression: a straggler note that became a warning is a regression).

Pure: takes two Diagnoses, returns plain data (schema ``ddpdoctor.compare/1``); renderers in
``reports/compare.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpdoctor.analysis.diagnosis import Diagnosis
from ddpdoctor.analysis.findings import SEVERITIES
from ddpdoctor.analysis.slow.phases import step_times
from ddpdoctor.trace import schema

SCHEMA = "ddpdoctor.compare/1"


def step_phases() -> list[str]:
    """The phases that happen every step (DDP init happens once per run)."""
    return [name for name, p in schema.PHASES.items() if p.per_step]


def _ratio(b: float | None, a: float | None) -> float | None:
    return round(b / a, 4) if a and b is not None else None


def step_distribution(diag: Diagnosis) -> dict[str, Any]:
    """Step times of every rank pooled (s): the distribution a user would see per step."""
    times = [step_times(t) for t in diag.run.ranks.values()]
    arr = np.concatenate(times) if times else np.zeros(0)
    if not len(arr):
        return {"count": 0, "mean": None, "p50": None, "p95": None, "max": None}
    p50, p95 = np.percentile(arr, [50, 95])
    return {
        "count": int(len(arr)),
        "mean": round(float(arr.mean()), 6),
        "p50": round(float(p50), 6),
        "p95": round(float(p95), 6),
        "max": round(float(arr.max()), 6),
    }


def phase_per_step(diag: Diagnosis) -> dict[str, float]:
    """Each phase's seconds per training step, averaged over ranks."""
    out: dict[str, float] = {}
    for phase in step_phases():
        per_rank = [
            stats[phase]["total_s"] / diag.steps[rank]
            for rank, stats in diag.phases.items()
            if phase in stats and diag.steps.get(rank)
        ]
        if per_rank:
            out[phase] = round(float(np.mean(per_rank)), 6)
    return out


def summary(diag: Diagnosis) -> dict[str, Any]:
    run = diag.run
    dist = step_distribution(diag)
    batch = diag.batch_size.get("global")
    mean = dist["mean"]
    return {
        "run_dirs": [str(d) for d in run.dirs],
        "command": run.command,
        "world_size": run.world_size,
        "exit_code": run.exit_code,
        "steps": max(diag.steps.values(), default=0),
        "global_batch": batch,
        "steps_per_s": round(1.0 / mean, 4) if mean else None,
        "samples_per_s": round(batch / mean, 3) if mean and batch else None,
        "step_time_s": dist,
        "phases_per_step_s": phase_per_step(diag),
        "findings": [f.to_json() for f in diag.findings],
    }


def compare(a: Diagnosis, b: Diagnosis) -> dict[str, Any]:
    """The comparison; ratios are B over A (above 1: B is larger)."""
    sa, sb = summary(a), summary(b)
    phases = {}
    for phase in step_phases():
        va, vb = sa["phases_per_step_s"].get(phase), sb["phases_per_step_s"].get(phase)
        if va is None and vb is None:
            continue
        phases[phase] = {
            "a": va,
            "b": vb,
            "delta_s": round((vb or 0.0) - (va or 0.0), 6),
            "ratio": _ratio(vb, va),
        }
    worst_a, worst_b = _worst(sa["findings"]), _worst(sb["findings"])
    return {
        "schema": SCHEMA,
        "a": {k: v for k, v in sa.items() if k != "findings"},
        "b": {k: v for k, v in sb.items() if k != "findings"},
        "throughput": {
            "steps_per_s_ratio": _ratio(sb["steps_per_s"], sa["steps_per_s"]),
            "samples_per_s_ratio": _ratio(sb["samples_per_s"], sa["samples_per_s"]),
        },
        "step_time_ratio": {
            q: _ratio(sb["step_time_s"][q], sa["step_time_s"][q]) for q in ("mean", "p50", "p95", "max")
        },
        "phases": phases,
        "findings": {
            "only_a": _worse(sa["findings"], worst_b),
            "only_b": _worse(sb["findings"], worst_a),
            "both": sorted(k for k, rank in worst_a.items() if worst_b.get(k) == rank),
        },
    }


def _worst(findings: list[dict[str, Any]]) -> dict[str, int]:
    """Each kind's most severe finding, as an index into SEVERITIES (0 is the worst)."""
    worst: dict[str, int] = {}
    for f in findings:
        rank = SEVERITIES.index(f["severity"])
        worst[f["kind"]] = min(rank, worst.get(f["kind"], rank))
    return worst


def _worse(findings: list[dict[str, Any]], other: dict[str, int]) -> list[dict[str, Any]]:
    """The findings the other run has not at this severity: kinds it has not, or has only as
    something milder (a straggler note in a healthy run, a straggler warning after a change:
    the warning is what changed). Each carries ``other_severity``, the other run's, if any."""
    out = []
    for f in findings:
        mine, theirs = SEVERITIES.index(f["severity"]), other.get(f["kind"])
        if theirs is None or mine < theirs:
            out.append({**f, "other_severity": None if theirs is None else SEVERITIES[theirs]})
    return out
