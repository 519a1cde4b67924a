"""One time base for every rank of a run, whichever host and run directory it came from.

Wall clocks of different hosts are not trusted: each rank's ``clock`` record (measured in the
rank against rank 0, see ``probes/clock.py``) moves its timestamps onto rank 0's wall clock
(``Run.offset_us``). Renderers then work in microseconds since the run's first event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ddpdoctor.trace import schema
from ddpdoctor.trace.rankfile import rank_view
from ddpdoctor.trace.reader import RankTrace, Run


@dataclass
class TimeBase:
    """Per-rank shifts onto a common clock whose zero is the run's earliest record."""

    origin_us: int  # rank 0's wall clock (µs since the epoch) at time zero
    shift_us: dict[int, int]  # add to a rank's trace timestamps to get µs since time zero
    clock_offset_us: dict[int, int | None]  # the measured offset to rank 0 (None: unmeasured)
    rtt_us: dict[int, int | None]
    notes: list[str] = field(default_factory=list)

    def rel(self, rank: int, ts: np.ndarray) -> np.ndarray:
        """A rank's timestamps (µs) on the common base."""
        return ts + self.shift_us[rank]

    @property
    def max_skew_us(self) -> int:
        """The largest clock offset measured (how wrong wall clocks alone would have been)."""
        return max((abs(v) for v in self.clock_offset_us.values() if v is not None), default=0)


def time_base(run: Run) -> TimeBase:
    """Align every rank of ``run`` on rank 0's clock; note ranks whose offset is unknown."""
    offsets = {rank: run.offset_us(rank) for rank in run.ranks}
    origin = min((offsets[rank] + _first_ts(trace) for rank, trace in run.ranks.items()), default=0)
    clock: dict[int, int | None] = {}
    rtt: dict[int, int | None] = {}
    for rank, trace in run.ranks.items():
        clock[rank] = trace.clock_offset_us()
        rec = trace.meta.get(schema.CLOCK)
        rtt[rank] = int(rec[0][2].get("rtt_ns", 0)) // 1000 if rec else None
    unmeasured = sorted(r for r, v in clock.items() if v is None)
    notes = []
    if unmeasured and len(run.hosts) > 1:
        notes.append(
            f"clock offset not measured on rank(s) {_ranks(unmeasured)}: their wall clocks are "
            "trusted, so events from different hosts may be misaligned"
        )
    return TimeBase(origin, {r: o - origin for r, o in offsets.items()}, clock, rtt, notes)


def _first_ts(trace: RankTrace) -> int:
    return int(trace.view(_first_event_ts))


@rank_view
def _first_event_ts(trace: RankTrace) -> int:
    """The earliest event's start (µs), 0 without events: computed where the trace is read."""
    firsts = [int(ev.ts.min()) for ev in trace.events.values() if len(ev)]
    return min(firsts, default=0)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:12]))
    return shown + (f" and {len(ranks) - 12} more" if len(ranks) > 12 else "")
