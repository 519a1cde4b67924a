"""`top` and the trace analysis judge lateness and stragglers alike: the same simulated job fed
through the writer taps (what the status files publish) and read as a trace gives the same
lateness and the same straggler verdict."""

from __future__ import annotations

import numpy as np
import pytest

from ddpdoctor.analysis import diagnose
from ddpdoctor.analysis.slow.synctable import sync_table
from ddpdoctor.live.lateness import live_lateness
from ddpdoctor.probes.recent import KEEP_STEPS, RecentSteps
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run
from ddpdoctor.trace.simulate import BASE_MS, Slowdown, simulate_run

STEP_MS = sum(BASE_MS.values())


def statuses_of(run: Run) -> dict[int, dict]:
    """What each rank's status would say at the end: its trace's events through the same taps
    the writer thread feeds (µs in the trace, ns in the taps)."""
    out = {}
    for rank, trace in run.ranks.items():
        recent = RecentSteps()
        events = []
        for kind in (schema.FORWARD, schema.ALLREDUCE):
            ev = trace.kind(kind)
            for ts, dur, step, fields in zip(ev.ts, ev.dur, ev.step, ev.fields):
                events.append(
                    (int(ts) * 1000, kind, (kind, int(ts) * 1000, int(ts + dur) * 1000, int(step), *fields))
                )
        for _, kind, event in sorted(events, key=lambda e: e[:2]):
            recent.taps()[kind](event)
        recent.finish()
        out[rank] = RankStatus(rank, **recent.status())
    return out


def verdicts(run: Run) -> tuple[set[int], set[int]]:
    """(ranks top calls stragglers, ranks the trace analysis calls persistent stragglers)."""
    table = live_lateness(statuses_of(run))
    live = {r for f in (table.stragglers() if table else []) for r in f["ranks"]}
    traced = {r for f in diagnose(run).findings if f.kind == "straggler" for r in f.ranks}
    return live, traced


def test_the_status_waits_give_the_trace_analysis_own_lateness() -> None:
    run = simulate_run(world=4, steps=KEEP_STEPS, slow=Slowdown(2, "forward", 5.0), seed=3)
    live, traced = live_lateness(statuses_of(run)), sync_table(run)
    assert live is not None and traced is not None
    # The trace analysis needs the step before each step (its backward's end): step 0 is not in it.
    common = [live.steps.index(s) for s in traced.steps.tolist()]
    assert live.ranks == traced.ranks and len(common) == KEEP_STEPS - 1
    np.testing.assert_allclose(live.lateness[:, common], traced.lateness, atol=1.0)  # µs


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("phase", ["data_wait", "forward", "optimizer"])
def test_top_and_the_trace_analysis_name_the_same_straggler(world: int, phase: str) -> None:
    rank = world - 1
    run = simulate_run(world=world, steps=KEEP_STEPS, slow=Slowdown(rank, phase, 0.2 * STEP_MS), seed=world)
    assert verdicts(run) == ({rank}, {rank})


@pytest.mark.parametrize("seed", range(4))
def test_top_and_the_trace_analysis_see_no_straggler_in_a_healthy_job(seed: int) -> None:
    assert verdicts(simulate_run(world=4, steps=KEEP_STEPS, seed=seed)) == (set(), set())


def test_top_and_the_trace_analysis_call_a_few_late_steps_no_persistent_straggler() -> None:
    run = simulate_run(world=4, steps=KEEP_STEPS, slow=Slowdown(1, "data_wait", 20.0, {3, 9}))
    assert verdicts(run) == (set(), set())


def test_two_ranks_need_the_chance_test_in_top_too() -> None:
    # One of two ranks latest on 14 of 16 steps is what chance gives now and then (p ~ 2e-3):
    # the trace analysis calls no persistent straggler, and neither does top (its old rule,
    # latest on 80 % of the steps, did).
    late = set(range(16)) - {5, 11}
    run = simulate_run(world=2, steps=16, slow=Slowdown(1, "forward", 0.2 * STEP_MS, late), seed=1)
    table = live_lateness(statuses_of(run))
    assert table is not None and table.per_rank()[1]["latest_share"] >= 0.8
    assert verdicts(run) == (set(), set())


def test_a_rank_the_others_waited_for_is_worth_sampling_before_the_rule_calls_it() -> None:
    """The profile starts on the rank the others waited for a fifth of the recent steps' time:
    a beat of its own work every 4th step (no persistent straggler), or a straggler only six
    steps old; not in a healthy job, nor for a few ms now and then."""
    beat = live_lateness(
        statuses_of(simulate_run(world=2, steps=24, slow=Slowdown(0, "other", 140.0, set(range(3, 24, 4)))))
    )
    assert beat is not None and beat.stragglers() == []
    assert beat.waited_for() is not None and beat.waited_for()["ranks"] == [0]
    young = live_lateness(statuses_of(simulate_run(world=4, steps=7, slow=Slowdown(2, "forward", 20.0))))
    assert young is not None and young.waited_for()["ranks"] == [2]
    for run in (
        simulate_run(world=4, steps=30),
        simulate_run(world=2, steps=30, slow=Slowdown(1, "other", 3.0)),
    ):
        table = live_lateness(statuses_of(run))
        assert table is not None and table.waited_for() is None
