"""Misuse detectors on simulated runs, for cases this CPU machine cannot produce for real."""

from __future__ import annotations

from ddpdoctor.analysis import diagnose
from ddpdoctor.trace import schema
from ddpdoctor.trace.simulate import simulate_run


def test_load_without_map_location_only_matters_on_gpus() -> None:
    for backend, expected in (("nccl", True), ("gloo", False)):
        run = simulate_run(world=4, steps=8)
        for rank, trace in run.ranks.items():
            trace.header["backend"] = backend
            mapped = rank == 3
            trace.meta[schema.LOAD] = [(0, 7, {"path": "/ckpt/last.pt", "map_location": mapped})]
        found = {f.kind: f for f in diagnose(run).findings}
        assert ("load_without_map_location" in found) is expected
        if expected:
            f = found["load_without_map_location"]
            assert f.ranks == [0, 1, 2] and f.details["paths"] == ["/ckpt/last.pt"]


def test_checkpoints_on_different_hosts_are_different_files() -> None:
    run = simulate_run(world=2, steps=8)
    for rank, trace in run.ranks.items():
        trace.header["host"] = f"node{rank}"
        trace.meta[schema.SAVE] = [(0, 7, {"path": "/local/ckpt.pt", "module_prefix": False})]
    assert "duplicate_checkpoint_writes" not in {f.kind for f in diagnose(run).findings}


def test_a_parameter_no_rank_ever_trains_is_a_warning_whatever_find_unused_parameters_says() -> None:
    for used, severity in ((0, "warning"), (1, "info")):  # used on no rank / on one rank of two
        run = simulate_run(world=2, steps=8)
        for trace in run.ranks.values():
            trace.meta[schema.UNUSED] = [
                (0, s, {"params": [1], "used_on_ranks": [used], "scope": "global"}) for s in range(8)
            ]
        (f,) = [f for f in diagnose(run).findings if f.kind == "unused_parameters"]
        assert f.severity == severity and "needed" not in f.summary
        if used == 0:
            assert "never trained" in f.summary and f.details["never_trained"] == ["#1"]
            assert "connect" in f.fix
