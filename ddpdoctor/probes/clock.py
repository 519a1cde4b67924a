"""Each rank's wall-clock offset to rank 0, measured once right after ``init_process_group``.

Hosts' wall clocks disagree (NTP drift, containers, no NTP at all), so traces from several
nodes cannot be merged on ``time.time_ns()`` alone. Every rank plays a few NTP-style
ping-pongs with rank 0 through the default store (never through the process group, so the
user's collective sequence numbers are untouched) and keeps the round with the smallest
round trip: ``offset = t_ref - (t_send + t_recv) / 2``, error at most ``rtt / 2``.

Rank 0 serves the ranks one after another; every wait is bounded, so a rank that never
answers costs at most a few seconds and never an error in the job.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

from ddpdoctor.probes import guard
from ddpdoctor.trace import schema

PROBE = "clock"
ROUNDS = 5
WAIT_S = 5.0  # one store wait (a ping or a pong)
SERVE_BUDGET_S = 20.0  # rank 0 stops serving after this long, whatever is left


def _wall_ns() -> int:
    # Looked up at each call (not bound at import) so a test job can skew this process's clock.
    return time.time_ns()


def measure(dist: Any, collector: Any, *, rounds: int = ROUNDS, wait_s: float = WAIT_S) -> None:
    """Record a ``clock`` metadata record on this rank; never raises (failures go to ``fail``)."""
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        store = dist.distributed_c10d._get_default_store()
        prefix = f"ddpdoctor/clock/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        if rank == 0:
            served = _serve(store, prefix, world, rounds, wait_s) if world > 1 else 0
            collector.meta(schema.CLOCK, {"offset_ns": 0, "rtt_ns": 0, "ref_rank": 0, "served": served})
            return
        offset, rtt = _ping(store, prefix, rank, rounds, wait_s)
        collector.meta(schema.CLOCK, {"offset_ns": offset, "rtt_ns": rtt, "ref_rank": 0, "rounds": rounds})
    except Exception as exc:
        collector.fail(PROBE, exc)


def _serve(store: Any, prefix: str, world: int, rounds: int, wait_s: float) -> int:
    """Rank 0: answer every rank's pings with the reference time; returns ranks served."""
    timeout = datetime.timedelta(seconds=wait_s)
    deadline = time.monotonic() + SERVE_BUDGET_S
    served = 0
    for peer in range(1, world):
        try:
            for i in range(rounds):
                if time.monotonic() > deadline:
                    return served
                store.wait([f"{prefix}/{peer}/{i}/ping"], timeout)
                store.set(f"{prefix}/{peer}/{i}/pong", str(_wall_ns()))
            served += 1
        except Exception as exc:
            guard.passthrough(exc)
            continue  # that rank is late or gone: serve the next one
    return served


def _ping(store: Any, prefix: str, rank: int, rounds: int, wait_s: float) -> tuple[int, int]:
    """Rank r: (offset to add to this wall clock to get rank 0's, round trip) of the best round."""
    timeout = datetime.timedelta(seconds=wait_s)
    best: tuple[int, int] | None = None
    for i in range(rounds):
        t_send = _wall_ns()
        store.set(f"{prefix}/{rank}/{i}/ping", "1")
        store.wait([f"{prefix}/{rank}/{i}/pong"], timeout)
        t_recv = _wall_ns()
        t_ref = int(store.get(f"{prefix}/{rank}/{i}/pong"))
        rtt = t_recv - t_send
        offset = t_ref - (t_send + t_recv) // 2
        if best is None or rtt < best[1]:
            best = (offset, rtt)
    assert best is not None
    return best
