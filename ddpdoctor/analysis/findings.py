"""Findings: what the doctor says, with evidence and a fix. Detectors register here."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run

SEVERITIES = ("error", "warning", "info")


@dataclass
class Finding:
    kind: str
    severity: str  # "error" | "warning" | "info"
    ranks: list[int]
    summary: str  # one line, plain words
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)  # the evidence: numbers, steps, names

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "ranks": self.ranks,
            "summary": self.summary,
            "fix": self.fix,
            "details": self.details,
        }


Detector = Callable[[Run], Iterable[Finding]]
DETECTORS: list[Detector] = []


_LARGE: list[Detector] = []  # those registered with large_detector, at the front of DETECTORS


def detector(func: Detector) -> Detector:
    """Register a detector; `find_all` runs every registered one."""
    DETECTORS.append(func)
    return func


def large_detector(func: Detector) -> Detector:
    """Register a detector that builds a large transient table (the straggler table: 250 MB at
    1,024 ranks x 10,000 steps): `find_all` runs these first, before the views the other
    detectors keep for the run (the ledgers) exist, so that the two never add up. The findings
    are sorted after: the order they are found in does not show."""
    DETECTORS.insert(len(_LARGE), func)
    _LARGE.append(func)
    return func


def find_all(run: Run) -> list[Finding]:
    """Every finding, most severe first."""
    found = [f for det in DETECTORS for f in det(run)]
    return sorted(found, key=lambda f: (SEVERITIES.index(f.severity), f.kind, f.ranks))


def clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters at a word's end, with "..." when cut: an error
    message quoted in a finding never ends mid-word."""
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0] if " " in text[:limit] else text[:limit]
    return cut.rstrip(" ,;:") + "..."


def rank_list(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


# Detector modules (failures, misuse, straggler, gradsync...) register on import: analysis/__init__.py.


@detector
def missing_ranks(run: Run) -> Iterable[Finding]:
    # A rank the supervisor saw start and end without initialising is no missing file:
    # rank_never_started says what became of it.
    known = {r for r, end in run.ends.items() if end.get("initialised") is False}
    missing = sorted(set(range(run.world_size)) - set(run.ranks) - known - set(run.elsewhere))
    if missing:
        yield Finding(
            "missing_ranks",
            "warning",
            missing,
            f"no trace from rank(s) {rank_list(missing)} of {run.world_size}",
            fix="Pass every node's run directory (ddpdoctor diagnose DIR1 DIR2 ...); a rank that "
            "died before init_process_group leaves no trace.",
            details={"world_size": run.world_size, "missing": missing},
        )


@detector
def probe_errors(run: Run) -> Iterable[Finding]:
    for rank, trace in sorted(run.ranks.items()):
        for _ts, step, info in trace.meta.get(schema.PROBE_ERROR, []):
            yield Finding(
                "probe_error",
                "info",
                [rank],
                f"rank {rank}: probe '{info.get('probe')}' switched itself off at step {step}",
                fix="Training was not affected; data from that probe is missing after that step. "
                "Please report it with probe-errors.log from the run directory.",
                details={"probe": info.get("probe"), "error": info.get("error"), "step": step},
            )
        dropped = trace.meta.get(schema.DROPPED, [])
        if dropped:
            count = max(int(info.get("count", 0)) for _, _, info in dropped)
            yield Finding(
                "events_dropped",
                "info",
                [rank],
                f"rank {rank}: {count} events dropped because the trace buffer was full",
                fix="Raise DDPDOCTOR_BUFFER_EVENTS or DDPDOCTOR_FLUSH_S lower if the disk keeps up.",
                details={"dropped": count},
            )
