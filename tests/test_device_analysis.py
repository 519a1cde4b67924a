"""Timing analyses prefer device spans: a straggler only the device sees is found, and a CPU
span that only measured launches no longer makes one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ddpdoctor.analysis import diagnose
from ddpdoctor.analysis.slow.device import clock, device_timed
from ddpdoctor.analysis.slow.gradsync import exposed_comm_us
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run
from ddpdoctor.trace.simulate import BASE_MS, Slowdown, simulate_run

DELAY_MS = 0.10 * sum(BASE_MS.values())


def with_device(cpu: Run, device: Run) -> Run:
    """``cpu``'s spans, plus ``device``'s forward/backward/optimizer/buckets as dev_* spans."""
    ranks = {}
    for rank, trace in cpu.ranks.items():
        events = dict(trace.events)
        for kind, dev in schema.DEVICE_KINDS.items():
            events[dev] = device.ranks[rank].kind(kind)
        ranks[rank] = replace(trace, events=events)
    return replace(cpu, ranks=ranks, derived={})


def stragglers(run: Run) -> list:
    return [f for f in diagnose(run).findings if f.kind == "straggler"]


def test_straggler_seen_only_on_the_device_is_named() -> None:
    healthy = simulate_run(world=4, steps=40, seed=1)
    slow = simulate_run(world=4, steps=40, slow=Slowdown(2, "backward", DELAY_MS), seed=1)
    assert stragglers(healthy) == []
    run = with_device(healthy, slow)
    assert clock(run) == "device" and clock(healthy) == "cpu"
    (f,) = stragglers(run)
    assert f.ranks == [2] and f.details["phase"] == "backward" and f.details["clock"] == "device"
    (truth,) = stragglers(slow)  # the same answer as a run that had only the device's times
    assert f.details["excess_ms_per_step"] == truth.details["excess_ms_per_step"]


def test_cpu_launch_times_are_ignored_when_device_spans_exist() -> None:
    slow_cpu = simulate_run(world=4, steps=40, slow=Slowdown(1, "forward", DELAY_MS), seed=2)
    assert [f.ranks for f in stragglers(slow_cpu)] == [[1]]
    healthy_device = simulate_run(world=4, steps=40, seed=2)
    assert stragglers(with_device(slow_cpu, healthy_device)) == []


def test_exposed_communication_from_device_spans() -> None:
    cpu = simulate_run(world=2, steps=20, seed=3)
    device = simulate_run(world=2, steps=20, seed=3, transfer_ms=9.0)
    exposed_cpu, _ = exposed_comm_us(cpu)
    exposed_dev, _ = exposed_comm_us(with_device(cpu, device))
    assert exposed_dev == pytest.approx(exposed_comm_us(device)[0]) and exposed_dev > exposed_cpu + 5000


def test_partial_device_spans_are_not_mixed_in() -> None:
    cpu = simulate_run(world=2, steps=20, seed=4)
    run = with_device(cpu, simulate_run(world=2, steps=20, seed=5))
    run.ranks[1].events.pop(schema.DEV_ALLREDUCE)
    assert device_timed(run) is run and clock(run) == "cpu"


def test_device_records_read_like_their_cpu_twins(tmp_path) -> None:
    """Version 2 lines of the dev_* kinds go through the bulk parser; version 1 files read as before."""
    import json

    from ddpdoctor.trace.reader import read_trace

    lines = [
        ["header", {"schema": "ddpdoctor.trace/2", "rank": 0, "world_size": 1, "wall_ns": 0, "mono_ns": 0}],
        ["forward", 0, 10, 0, 1, 1, 3, 0],
        ["dev_forward", 5, 20, 0, 1, 1, 3, 7],
        ["dev_backward", 30, 40, 0],
        ["dev_bucket", 50, 7, 0, 2, 4096, 4],
        ["dev_optimizer", 80, 3, 0, "AdamW"],
    ]
    path = tmp_path / "trace-rank0.jsonl"
    path.write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))
    t = read_trace(path)
    assert t.skipped_lines == 0 and not t.meta
    assert list(t.kind(schema.DEV_FORWARD).fields) == [(1, 1, 3, 7)]
    assert t.kind(schema.DEV_BACKWARD).dur.tolist() == [40]
    ar = t.kind(schema.DEV_ALLREDUCE)
    assert (ar.ts.tolist(), list(ar.fields)) == ([50], [(2, 4096, 4)])
    assert list(t.kind(schema.DEV_OPTIMIZER).fields) == [("AdamW",)]
    lines[0][1]["schema"] = "ddpdoctor.trace/1"
    path.write_text("".join(json.dumps(line[:1] + line[1:]) + "\n" for line in lines[:2]))
    assert read_trace(path).steps == 1
