"""The line that makes a straggler late: its profile against a punctual peer's, line by line.

While the job ran, the supervisor sampled the straggler and the most punctual other rank of
its node side by side, wall-clock, idle samples included (supervisor/profile.py). Both run the
same script, so a line where the straggler spends a clearly larger share of its time than the
peer is where its extra time goes; the peer's own larger shares are the waits for it. Clearly:
by at least ``MIN_GAP`` of the time and ``Z`` standard errors of the difference of two
proportions, on ``MIN_SAMPLES`` samples of each rank and ``MIN_AT_LINE`` of the straggler's at
the line (the normal approximation's ground; a short job ends its profile early, and half a
second of a line that takes half the straggler's time is still plain). Otherwise nothing is
said.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ddpdoctor.trace.reader import Run

MIN_SAMPLES = 50
MIN_AT_LINE = 10
MIN_GAP = 0.05
Z = 4.0


def straggler_line(run: Run, rank: int) -> dict[str, Any] | None:
    """Where ``rank``'s extra time went, from a profile taken while it straggled, or None."""
    for profile in run.profiles:
        if profile.get("straggler") != rank or profile.get("error"):
            continue
        ranks = profile.get("ranks") or {}
        peer = profile.get("peer")
        mine, theirs = ranks.get(str(rank)) or {}, ranks.get(str(peer)) or {}
        n1, n2 = int(mine.get("samples") or 0), int(theirs.get("samples") or 0)
        if min(n1, n2) < MIN_SAMPLES:
            continue
        counts = {(f, file, line): n for f, file, line, n, *_ in theirs.get("lines") or []}
        best: dict[str, Any] | None = None
        for function, file, line, n, *callers in mine.get("lines") or []:
            other = counts.get((function, file, line), 0)
            gap = n / n1 - other / n2
            pooled = (n + other) / (n1 + n2)
            se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / n1 + 1 / n2))
            if n >= MIN_AT_LINE and gap >= MIN_GAP and gap >= Z * se and (best is None or gap > best["gap"]):
                best = {
                    "where": _where(function, file, line),
                    "file": file,
                    "line": line,
                    "function": function,
                    "callers": [_where(*frame) for frame in (callers[0] if callers else [])],
                    "share": round(n / n1, 3),
                    "peer": peer,
                    "peer_share": round(other / n2, 3),
                    "gap": round(gap, 3),
                    "samples": n1,
                    "seconds": profile.get("seconds"),
                }
        if best is not None:
            return best
    return None


def _where(function: str, file: str, line: int) -> str:
    return f"{function}() {os.path.basename(file)}:{line}"


def line_text(found: dict[str, Any]) -> str:
    """'; sampled while it lagged, it spent 41 % of its time at despeckle() train.py:23 (rank 0:
    2 %), called from Tiles.__getitem__() train.py:40, from main() train.py:71'."""
    called = "".join(
        f", {'called ' if i == 0 else ''}from {where}" for i, where in enumerate(found.get("callers") or [])
    )
    return (
        f"; sampled while it lagged, it spent {100 * found['share']:.0f} % of its time at "
        f"{found['where']} (rank {found['peer']}: {100 * found['peer_share']:.0f} %){called}"
    )
