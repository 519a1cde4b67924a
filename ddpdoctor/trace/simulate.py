"""A simulated DDP job, in memory: ground truth for unit tests and the accuracy benchmark.

Each rank runs optimizer -> other -> data wait -> forward -> backward per step with jittered
phase times; gradient buckets become ready during backward and each bucket's all-reduce
finishes when the last rank's copy is ready plus a transfer time, as in a real ring. One
rank can be slowed in one phase to make a straggler whose answer is known.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddpdoctor.trace import schema
from ddpdoctor.trace.columns import Events
from ddpdoctor.trace.reader import RankTrace, Run

BASE_MS = {"optimizer": 2.0, "other": 1.0, "data_wait": 2.0, "forward": 10.0, "backward": 15.0}


@dataclass
class Slowdown:
    rank: int
    phase: str  # one of BASE_MS
    delay_ms: float
    steps: set[int] | None = None  # None: every step
    starved: float = 0.0  # the share of the delay spent ready to run with no CPU (the run queue)
    also: tuple[int, ...] = ()  # more ranks slowed the same way (a slow node)

    def hits(self, rank: int) -> bool:
        return rank == self.rank or rank in self.also


def simulate_run(
    world: int = 4,
    steps: int = 40,
    *,
    slow: Slowdown | None = None,
    base_ms: dict[str, float] | None = None,
    jitter: float = 0.05,
    buckets: int = 3,
    transfer_ms: float = 1.0,
    seed: int = 0,
    ranks_per_host: int = 0,  # 0: every rank on one host
    timed_buckets: bool = True,  # False: no bucket all-reduce records (DDPDOCTOR_BUCKET_TIMING)
) -> Run:
    rng = random.Random(seed)
    base = dict(BASE_MS if base_ms is None else base_ms)
    cols: dict[int, dict[str, list]] = {r: {} for r in range(world)}

    def add(rank: int, kind: str, ts: float, dur: float, step: int, *fields: object) -> None:
        c = cols[rank].setdefault(kind, [[], [], [], []])
        c[0].append(int(ts * 1e3))
        c[1].append(int(dur * 1e3))
        c[2].append(step)
        c[3].append(tuple(fields))

    sync_end = [0.0] * world
    runq = [0.0] * world  # each rank's run-queue delay so far, ms (what BACKWARD records)
    for step in range(steps):
        ready = np.zeros((world, buckets))
        bwd_start = [0.0] * world
        for r in range(world):
            d = {p: max(0.0, v * (1 + jitter * rng.gauss(0, 1))) for p, v in base.items()}
            if slow and slow.hits(r) and (slow.steps is None or step in slow.steps):
                d[slow.phase] += slow.delay_ms
                runq[r] += slow.delay_ms * float(slow.starved)
            t = sync_end[r]
            if step:
                add(r, schema.OPTIMIZER, t, d["optimizer"], step - 1, "SGD")
            t += d["optimizer"] + d["other"]
            add(r, schema.DATA_WAIT, t, d["data_wait"], step - 1, 1)
            t += d["data_wait"]
            add(r, schema.FORWARD, t, d["forward"], step, 1, 1, step * (buckets + 1), -1)
            t += d["forward"]
            bwd_start[r] = t
            for b in range(buckets):  # buckets ready evenly through the backward
                ready[r, b] = t + d["backward"] * (b + 1) / buckets
        done = ready.max(axis=0) + transfer_ms
        for b in range(1, buckets):
            done[b] = max(done[b], done[b - 1] + transfer_ms)
        for r in range(world):
            for b in range(buckets if timed_buckets else 0):
                add(r, schema.ALLREDUCE, ready[r, b], done[b] - ready[r, b], step, b, 1 << 20, step)
            end = done[-1] + 0.05
            add(r, schema.BACKWARD, bwd_start[r], end - bwd_start[r], step, int(runq[r] * 1e3))
            sync_end[r] = end
    ranks = {}
    for r in range(world):
        header = {
            "schema": schema.SCHEMA,
            "rank": r,
            "world_size": world,
            "host": f"node{r // ranks_per_host}" if ranks_per_host else "sim",
            "pid": 1000 + r,
            "wall_ns": 0,
            "mono_ns": 0,
            "backend": "gloo",
        }
        events = {
            kind: Events(
                np.asarray(c[0], dtype=np.int64),
                np.asarray(c[1], dtype=np.int64),
                np.asarray(c[2], dtype=np.int64),
                c[3],
            )
            for kind, c in cols[r].items()
        }
        ranks[r] = RankTrace(r, header, Path(f"sim/trace-rank{r}.bin"), events, {})
    return Run([Path("sim")], [{"exit_code": 0}], ranks)
