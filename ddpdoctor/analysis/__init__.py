"""Analysis: pure functions from a Run (merged traces) to statistics and findings.

Nothing here imports torch or touches a live process, so every judgement can be unit-tested
on synthetic traces. The modules are grouped by the question they answer:

* ``hung/``: is the job hung, and on what (the live proof, the hang verdict, waits on a busy rank);
* ``failed/``: who failed or parted first, and what followed (ledgers, causes, the failure view);
* ``slow/``: where the time goes (stragglers, periodic work, gradient sync, phases, GPUs);
* ``misuse/``: is DDP used as meant (unused parameters, sampling, frameworks, replicas);
* ``diagnosis.py`` and ``findings.py`` tie them into one Diagnosis of findings.
"""

# Each detector module registers its findings on import; this is the one list of them.
from ddpdoctor.analysis.diagnosis import Diagnosis, diagnose
from ddpdoctor.analysis.failed import causes, failures, nodes  # noqa: F401
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.hung import awaited, waits  # noqa: F401
from ddpdoctor.analysis.misuse import divergence, usage  # noqa: F401
from ddpdoctor.analysis.slow import gpu_findings, gradsync, periodic, straggler  # noqa: F401

__all__ = ["Diagnosis", "Finding", "diagnose"]
