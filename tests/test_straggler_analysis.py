"""Straggler analysis on simulated runs whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from ddpdoctor.analysis import diagnose
from ddpdoctor.analysis.slow.phases import last_buckets
from ddpdoctor.trace.simulate import BASE_MS, Slowdown, simulate_run

STEP_MS = sum(BASE_MS.values())


def stragglers(run):
    return [f for f in diagnose(run).findings if f.kind.startswith("straggler") or f.kind == "slow_node"]


@pytest.mark.parametrize("phase", ["data_wait", "forward", "backward", "optimizer", "other"])
@pytest.mark.parametrize("rank", [0, 3])
def test_persistent_straggler_rank_and_phase(phase: str, rank: int) -> None:
    # 150 ms steps: 15 ms a step for 40 steps is a cost worth a warning (0.6 s)
    delay = 0.10 * 5 * STEP_MS
    base = {p: 5 * ms for p, ms in BASE_MS.items()}
    run = simulate_run(world=4, steps=40, base_ms=base, slow=Slowdown(rank, phase, delay), seed=rank)
    (f,) = stragglers(run)
    assert (f.kind, f.severity, f.ranks) == ("straggler", "warning", [rank])
    assert f.details["phase"] == phase
    assert f.details["excess_ms_per_step"] == pytest.approx(delay, rel=0.25)
    step_ms = f.details["step_ms"]
    assert f.details["what_if_speedup"] == pytest.approx(step_ms / (step_ms - delay), rel=0.05)


def test_a_steady_straggler_that_cost_a_short_run_little_is_a_note() -> None:
    """Severity follows cost: 3 ms a step over 40 steps is 0.1 s in all, too little to warn
    about, and in a run that short one moment of contention on the host can cover most steps."""
    run = simulate_run(world=4, steps=40, slow=Slowdown(1, "forward", 0.10 * STEP_MS), seed=1)
    (f,) = stragglers(run)
    assert (f.kind, f.severity, f.ranks, f.details["phase"]) == ("straggler", "info", [1], "forward")
    assert f.details["lost_s"] == pytest.approx(0.12, rel=0.25)
    assert "a note, not a warning, until it costs more" in f.summary


@pytest.mark.parametrize("phase", ["data_wait", "forward", "optimizer", "other"])
def test_without_bucket_timings_a_straggler_is_measured_by_its_time_in_backward(phase: str) -> None:
    """Untimed, every rank still leaves backward as the last reduction ends: the shortest
    backward is the latest arrival. What a rank does before its backward is seen."""
    delay = 0.10 * STEP_MS
    run = simulate_run(world=4, steps=40, slow=Slowdown(2, phase, delay), seed=1, timed_buckets=False)
    (f,) = stragglers(run)
    assert (f.kind, f.ranks, f.details["phase"]) == ("straggler", [2], phase)
    assert f.details["excess_ms_per_step"] == pytest.approx(delay, rel=0.25)
    assert "started its backward" in diagnose(run).lateness.definition


def test_without_bucket_timings_a_rank_slow_inside_its_backward_is_not_blamed_on_another() -> None:
    run = simulate_run(world=4, steps=40, slow=Slowdown(2, "backward", 3.0), seed=1, timed_buckets=False)
    assert all(f.ranks == [2] for f in stragglers(run))  # not seen, or seen as itself
    for seed in range(5):
        assert stragglers(simulate_run(world=8, steps=60, seed=seed, timed_buckets=False)) == []


def test_healthy_run_has_no_straggler() -> None:
    for seed in range(5):
        assert stragglers(simulate_run(world=8, steps=60, seed=seed)) == []


def test_occasional_straggler_is_told_apart_and_names_its_steps() -> None:
    slow_steps = {5, 17, 30}
    run = simulate_run(world=4, steps=40, slow=Slowdown(2, "data_wait", 20.0, slow_steps))
    (f,) = stragglers(run)
    assert (f.kind, f.severity, f.ranks) == ("straggler_occasional", "info", [2])
    assert set(f.details["late_steps"]) == slow_steps
    assert f.details["phase"] == "data_wait"


def test_a_costly_occasional_stall_is_a_warning_unless_the_rank_waited_for_a_cpu() -> None:
    # 4 stalls of 300 ms in 40 steps of 30 ms: 1.2 s, half the job's time, lost by every rank.
    stalls = {5, 17, 22, 36}  # irregular: not periodic rank work
    run = simulate_run(world=2, steps=40, slow=Slowdown(1, "backward", 300.0, stalls))
    (f,) = stragglers(run)
    assert (f.kind, f.severity, f.ranks) == ("straggler_occasional", "warning", [1])
    assert f.details["cpu_wait_ms"] == pytest.approx(0, abs=0.5)
    # The same stalls spent in the run queue: the host had no CPU for it, the code is not at fault.
    run = simulate_run(world=2, steps=40, slow=Slowdown(1, "backward", 300.0, stalls, starved=1.0))
    (f,) = stragglers(run)
    assert (f.kind, f.severity, f.ranks) == ("straggler_occasional", "info", [1])
    assert f.details["cpu_wait_ms"] == pytest.approx(300, rel=0.05)
    assert "waiting for a CPU" in f.summary and "OMP_NUM_THREADS" in f.fix


def test_a_rank_with_more_work_that_also_waits_longer_for_a_cpu_is_blamed_on_its_work() -> None:
    """On a crowded host the rank with extra work also waits longer for a CPU, and that wait can
    be half its lateness: the work is the cause (without the wait it would still be late), the
    host only stretches it. Only a lateness the CPU wait explains away is the host's."""
    base = {p: 5 * ms for p, ms in BASE_MS.items()}
    own = simulate_run(world=2, steps=40, base_ms=base, slow=Slowdown(1, "other", 20.0, starved=0.5))
    (f,) = stragglers(own)
    assert (f.kind, f.severity, f.ranks, f.details["phase"]) == ("straggler", "warning", [1], "other")
    assert f.details["cpu_wait_ms"] == pytest.approx(10, rel=0.1) and "waiting for a CPU" in f.summary
    assert "OMP_NUM_THREADS" not in f.fix and "your own code between steps" in f.fix
    host = simulate_run(world=2, steps=40, base_ms=base, slow=Slowdown(1, "other", 20.0, starved=1.0))
    (f,) = stragglers(host)
    assert f.kind == "straggler" and "OMP_NUM_THREADS" in f.fix


def test_a_rank_whose_extra_phase_time_its_cpu_wait_explains_is_the_hosts_doing() -> None:
    """A healthy job beside another on a 2-core host (held-out set 24): rank 1 late by 22.0 ms a
    step, 18.2 ms of it in the run queue, its phases 17.4 ms longer than rank 0's (the medians of
    lateness and of each phase, taken apart, differ by a few ms). Its phases' extra time is the
    wait: the host's doing. A rank 20 ms slower in its own work that waits 10 ms more is not."""
    from ddpdoctor.analysis.slow.straggler import host_starved

    assert host_starved(22_000, 17_400, 18_200, 2_170)
    assert not host_starved(22_000, 22_000, 18_200, 2_170)  # 3.8 ms of its own: its work
    assert not host_starved(20_000, 20_000, 10_000, 1_500)


def test_occasional_stalls_of_a_few_ms_in_all_are_no_warning() -> None:
    # 4 stalls of 25 ms in a 40-step job: 100 ms lost, 8 % of a short job: noise-sized.
    run = simulate_run(world=2, steps=40, slow=Slowdown(0, "backward", 25.0, {5, 17, 22, 36}))
    (f,) = stragglers(run)
    assert (f.kind, f.severity) == ("straggler_occasional", "info")


def test_too_few_steps_says_nothing() -> None:
    assert stragglers(simulate_run(world=4, steps=4, slow=Slowdown(1, "forward", 30.0))) == []


def test_two_noisy_ranks_in_a_short_run_are_not_stragglers() -> None:
    # With two ranks one of them is always the latest; 7 of 11 steps is a coin's doing.
    # Without the chance test 12 of these 200 short noisy runs were called stragglers.
    scale = 4.0 / STEP_MS
    base = {phase: ms * scale for phase, ms in BASE_MS.items()}
    for seed in range(200):
        run = simulate_run(
            world=2, steps=12, base_ms=base, jitter=0.15, buckets=1, transfer_ms=0.3, seed=seed
        )
        assert [f for f in stragglers(run) if f.severity == "warning"] == [], seed


def test_chance_of_being_latest() -> None:
    from ddpdoctor.analysis.slow.straggler import by_chance

    assert by_chance(7, 11, 2) > 0.2  # a coin
    assert by_chance(11, 11, 2) < 0.001
    assert by_chance(0, 10, 4) == pytest.approx(1.0)
    assert by_chance(10, 40, 4) > 0.4  # a quarter of the steps is what any rank gets
    assert by_chance(6000, 10000, 1024) < 1e-300  # long runs, many ranks: no float overflow
    assert by_chance(10, 10000, 1024) > 0.5


def test_a_node_whose_every_rank_is_late_is_a_slow_node_not_one_rank_now_and_then() -> None:
    # Node 1 (ranks 2, 3) is slow in data loading: whichever of its two ranks is the latest
    # changes from step to step, so neither is a straggler alone; the node is.
    slow = Slowdown(2, "data_wait", 0.2 * STEP_MS, also=(3,))
    run = simulate_run(world=4, steps=100, slow=slow, ranks_per_host=2)
    found = stragglers(run)
    assert [(f.kind, f.severity, f.ranks) for f in found] == [("slow_node", "warning", [2, 3])]
    assert "node node1 is slow as a whole" in found[0].summary and found[0].details["phase"] == "data_wait"
    healthy = simulate_run(world=4, steps=40, ranks_per_host=2)
    assert stragglers(healthy) == []
    one = simulate_run(world=4, steps=40, slow=Slowdown(2, "data_wait", 0.2 * STEP_MS), ranks_per_host=2)
    assert [f.kind for f in stragglers(one)] == ["straggler"], "one slow rank of a node is that rank"


def test_a_few_long_stalls_among_jitter_are_the_cost() -> None:
    """Rank 1 stalls 100-350 ms on 4 steps and is a few ms late on a dozen others (a loaded
    host): the stalls make the cost, so they are what the finding describes, not the jitter."""
    from ddpdoctor.analysis.slow.stalls import costliest

    lateness = np.full(40, 3_000.0)
    stalls = [4, 12, 20, 28]
    lateness[stalls] = [133_000, 356_000, 349_000, 268_000]
    late = lateness > 900
    assert np.flatnonzero(costliest(lateness, late)).tolist() == stalls
    even = np.full(40, 5_000.0)  # lateness spread evenly: every late step is the cost
    assert costliest(even, even > 900).sum() == 40


def test_last_bucket_of_each_step_whatever_the_layout() -> None:
    """The event the straggler table and the periodic rule time each step by: the first event
    of the step's highest bucket index, whether the steps' buckets make a table (one layout or
    several) or not."""
    rng = np.random.default_rng(5)
    for trial in range(300):
        nb, steps = int(rng.integers(1, 6)), int(rng.integers(1, 20))
        index = np.tile(rng.permutation(nb), steps)  # one layout, every step
        if trial % 3 == 1:
            index = rng.integers(0, nb, nb * steps)  # a layout per step, a top index repeated
        step = np.repeat(np.arange(steps), nb)
        if trial % 3 == 2:  # uneven steps
            keep = rng.random(len(step)) < 0.7
            step, index = step[keep], index[keep]
        top = [np.flatnonzero((step == s) & (index == index[step == s].max()))[0] for s in np.unique(step)]
        assert last_buckets(step, index).tolist() == top


def test_the_table_compares_only_steps_every_rank_numbered_alike() -> None:
    """Under a Join context the rank that ran out of batches shadows the others' last all-reduces
    with no steps of its own, so its step 28 is another rank's step 40: the gradient buckets'
    sequence numbers differ. Steps whose last buckets the ranks numbered differently are not
    one step across them and stay out of the straggler table, as out of the periodic rule."""
    from ddpdoctor.analysis.slow.synctable import sync_table
    from ddpdoctor.trace import schema
    from ddpdoctor.trace.columns import Events

    run = simulate_run(world=2, steps=40)
    ar = run.ranks[1].events[schema.ALLREDUCE]
    steps = ar.step.tolist()
    fields = [(f[0], f[1], f[2] + 100 * (s >= 25)) for f, s in zip(ar.fields, steps, strict=True)]
    run.ranks[1].events[schema.ALLREDUCE] = Events(
        np.asarray(ar.ts), np.asarray(ar.dur), np.asarray(steps), fields
    )
    table = sync_table(run)
    assert table is not None
    assert table.steps.min() <= 2 and table.steps.max() == 24
    assert sync_table(simulate_run(world=2, steps=40)).steps.max() == 39  # numbered alike: all kept
