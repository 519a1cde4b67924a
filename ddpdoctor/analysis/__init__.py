"""Analysis: pure functions from a Run (merged traces) to statistics and findings.

Nothing here imports torch or touches a live process, so every judgement can be unit-tested
on synthetic traces.
"""

from ddpdoctor.analysis import failures as _failures  # noqa: F401  (registers detectors)
from ddpdoctor.analysis.diagnosis import Diagnosis, diagnose
from ddpdoctor.analysis.findings import Finding

__all__ = ["Diagnosis", "Finding", "diagnose"]
