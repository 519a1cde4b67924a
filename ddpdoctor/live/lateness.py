"""Lateness and stragglers of a running job, judged by the trace analysis's own rule.

The only adapter from live data to analysis/slow/straggler.py: each rank's status carries its
wait in the last gradient bucket's all-reduce for its last completed steps (``sync_wait_us``,
probes/recent.py), the same quantity the trace analysis reads from the bucket spans. Lined up
by step, those waits become the analysis's (ranks, steps) lateness (``lateness_from_waits``)
and the analysis's straggler rule (``persistent_stragglers``: share of steps, stand-out and
chance test) decides. What the status cannot show, the phase that makes a rank late, is left
to `ddpdoctor diagnose` on the trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddpdoctor.analysis.slow.straggler import late_threshold_us, persistent_stragglers
from ddpdoctor.analysis.slow.synctable import MIN_STEPS, lateness_from_waits
from ddpdoctor.probes.status import RankStatus

MAX_SPAN = 10_000  # steps between the ranks' oldest and newest published step: a corrupt status
# A rank the others waited for this share of the recent steps' time is worth sampling at once
# (supervisor/profile.py), before the straggler rule has the steps to call it one, or when its
# lateness comes in beats (rank-only work every N steps), which that rule leaves to the trace.
WAITED_SHARE = 0.2


@dataclass
class LiveLateness:
    """Rank x step lateness (µs) over the recent steps every rank published."""

    ranks: list[int]
    steps: list[int]
    lateness: np.ndarray  # (ranks, steps)
    step_us: float  # the job's step period (its slowest rank's), 0 when unknown

    def per_rank(self) -> dict[int, dict[str, Any]]:
        """Mean lateness and the share of the steps on which each rank was the latest."""
        n = len(self.steps)
        latest = np.bincount(self.lateness.argmax(axis=0), minlength=len(self.ranks))
        mean = self.lateness.mean(axis=1)
        return {
            rank: {"mean_us": float(mean[i]), "latest_share": round(float(latest[i]) / n, 3), "steps": n}
            for i, rank in enumerate(self.ranks)
        }

    def stragglers(self) -> list[dict[str, Any]]:
        """A ``straggler`` finding for each rank the trace analysis's rule calls persistent."""
        if len(self.steps) < MIN_STEPS or not self.step_us:
            return []  # as sync_table and the detector: too few steps, or no step period
        latest, persistent = persistent_stragglers(self.lateness, late_threshold_us(self.step_us))
        out = []
        for row in np.flatnonzero(persistent):
            rank, share = self.ranks[row], float((latest == row).mean())
            mean_ms = float(self.lateness[row].mean()) / 1000
            text = (
                f"rank {rank} arrives last at the gradient sync on {share:.0%} of the last "
                f"{len(self.steps)} steps, {mean_ms:.1f} ms late on average: the other ranks wait for it"
            )
            out.append({"kind": "straggler", "ranks": [rank], "text": text})
        return out

    def waited_for(self) -> dict[str, Any] | None:
        """The rank the others waited for the longest over the recent steps, where that wait is
        at least ``WAITED_SHARE`` of their time; None otherwise. A reason to sample it, not a
        finding: the trace analysis judges what the samples show."""
        if len(self.steps) < MIN_STEPS or not self.step_us:
            return None
        share = self.lateness.sum(axis=1) / (len(self.steps) * self.step_us)
        row = int(share.argmax())
        if share[row] < WAITED_SHARE:
            return None
        rank, n = self.ranks[row], len(self.steps)
        text = (
            f"the other ranks waited for rank {rank} {min(1.0, share[row]):.0%} of the last {n} steps' time"
        )
        return {"kind": "waited_for", "ranks": [rank], "text": text}


def live_lateness(statuses: Mapping[int, RankStatus]) -> LiveLateness | None:
    """The ranks' published last-bucket waits lined up by step; None when a rank published
    none (lateness is then unknown for all), with fewer than two ranks, or no shared step.
    Plain lists first, one array at the end: a thousand ranks cost a few milliseconds."""
    ranks, series = [], []
    for rank, st in statuses.items():
        pairs = st.sync_wait_us
        if not isinstance(pairs, list) or not pairs:
            return None
        ranks.append(rank)
        series.append(pairs)
    if len(ranks) < 2:
        return None
    try:
        lo = max(int(p[0][0]) for p in series)  # each rank publishes its steps in order
        hi = min(int(p[-1][0]) for p in series)
        if hi < lo or hi - lo > MAX_SPAN:
            return None
        nan = float("nan")
        rows = []
        for pairs in series:
            first = int(pairs[0][0])
            if int(pairs[-1][0]) - first == len(pairs) - 1:  # consecutive steps: one slice
                rows.append([p[1] for p in pairs[lo - first : hi - first + 1]])
                continue
            row = [nan] * (hi - lo + 1)
            for step, wait in pairs:
                if lo <= step <= hi:
                    row[step - lo] = wait
            rows.append(row)
        waits = np.array(rows, dtype=np.float64)
    except (TypeError, ValueError, IndexError):
        return None
    shared = ~np.isnan(waits).any(axis=0)  # the steps every rank has
    if not shared.any():
        return None
    rates = [float(s.steps_per_s) for s in statuses.values() if s.steps_per_s]
    step_us = 1e6 / min(rates) if rates else 0.0  # every DDP step waits for the slowest rank
    steps = [lo + i for i in np.flatnonzero(shared).tolist()]
    return LiveLateness(ranks, steps, lateness_from_waits(waits[:, shared]), step_us)
