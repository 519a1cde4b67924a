"""benchmarks/gpu_check.py cannot run here (no GPU): its plan and its checks are tested on
simulated runs whose device spans carry a known answer."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
from test_device_analysis import DELAY_MS, with_device

from ddpdoctor.analysis import diagnose
from ddpdoctor.trace import schema
from ddpdoctor.trace.columns import Events
from ddpdoctor.trace.simulate import Slowdown, simulate_run
from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_plan() -> None:
    assert gpu_check.plan(1) == ("gloo", 2)
    assert gpu_check.plan(8) == ("nccl", 8)
    with pytest.raises(SystemExit):
        gpu_check.plan(0)


def findings(run) -> list[dict]:
    return [f.to_json() for f in diagnose(run).findings]


def test_straggler_check_wants_the_slow_rank_in_backward_on_the_device() -> None:
    healthy = simulate_run(world=2, steps=40, seed=7)
    slow_dev = simulate_run(world=2, steps=40, slow=Slowdown(1, "backward", DELAY_MS), seed=7)
    assert gpu_check.check_straggler(findings(with_device(healthy, slow_dev)), 1) is None
    assert gpu_check.check_straggler(findings(with_device(healthy, slow_dev)), 0) is not None
    assert gpu_check.check_straggler(findings(slow_dev), 1) is not None  # CPU clock only: not enough
    wrong_phase = simulate_run(world=2, steps=40, slow=Slowdown(1, "forward", DELAY_MS), seed=7)
    assert gpu_check.check_straggler(findings(with_device(healthy, wrong_phase)), 1) is not None


def test_bucket_check() -> None:
    cpu = simulate_run(world=2, steps=10, seed=8)
    run = with_device(cpu, cpu)
    assert gpu_check.check_buckets(run) is None
    assert "no device all-reduce" in gpu_check.check_buckets(cpu)
    trace = run.ranks[1]
    ar = trace.kind(schema.DEV_ALLREDUCE)
    zero = Events(ar.ts, np.where(ar.step == 3, 0, ar.dur), ar.step, list(ar.fields))
    events = {**trace.events, schema.DEV_ALLREDUCE: zero}
    broken = replace(run, ranks={**run.ranks, 1: replace(trace, events=events)}, derived={})
    assert "zero length" in gpu_check.check_buckets(broken)


def test_step_time_from_device_spans() -> None:
    run = with_device(*(simulate_run(world=2, steps=30, jitter=0.0, seed=9),) * 2)
    fwd = run.ranks[0].kind(schema.FORWARD)
    truth = float(np.median(np.diff(fwd.ts[fwd.ints(0) == 1]))) / 1e6
    assert gpu_check.device_step_s(run) == pytest.approx(truth, rel=0.01)
    assert gpu_check.check_step_time(0.1, 0.104) is None
    assert gpu_check.check_step_time(0.1, 0.106) is not None
    assert gpu_check.check_step_time(0.1, 0.0) is not None


def test_fingerprint_check_wants_every_rank_checked_and_equal(tmp_path) -> None:
    from ddpdoctor.rundir import RunDir
    from ddpdoctor.trace.reader import load_run
    from ddpdoctor.trace.synthetic import SyntheticJob, append_records, write_run

    def run_with(values_of_rank1: list[int], name: str):
        (run_dir,) = write_run(SyntheticJob(ranks=2, steps=4), tmp_path / name)
        for rank in (0, 1):
            values = [1, 2, 9] if rank == 0 else values_of_rank1
            init = {"model": 0, "at": "init", "values": [1, 2, 9], "names": ["w", "b", "buf"], "n_params": 2}
            step = {"model": 0, "at": "step", "values": values}
            lines = [[schema.FINGERPRINT, 10, 0, -1, init], [schema.FINGERPRINT, 20, 0, 0, step]]
            append_records(RunDir(run_dir).trace(rank), lines)
        return load_run([run_dir])

    equal = run_with([1, 2, 7], "equal")  # a buffer may differ; the parameters agree
    assert gpu_check.check_fingerprints(equal, findings(equal)) is None
    differ = run_with([1, 3, 9], "differ")
    assert "differs" in gpu_check.check_fingerprints(differ, [])
    assert "divergence reported" in gpu_check.check_fingerprints(equal, [{"kind": "weights_diverged"}])
    assert "no fingerprint" in gpu_check.check_fingerprints(simulate_run(world=2, steps=4, seed=1), [])
