"""Analysis: pure functions from a Run (merged traces) to statistics and findings.

Nothing here imports torch or touches a live process, so every judgement can be unit-tested
on synthetic traces.
"""

# Each detector module registers its findings on import; this is the one list of them.
from ddpdoctor.analysis import (  # noqa: F401
    causes,
    divergence,
    failures,
    gpu_findings,
    gradsync,
    misuse,
    nodes,
    periodic,
    straggler,
    waits,
)
from ddpdoctor.analysis.diagnosis import Diagnosis, diagnose
from ddpdoctor.analysis.findings import Finding

__all__ = ["Diagnosis", "Finding", "diagnose"]
