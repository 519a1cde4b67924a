"""Misuse detectors on simulated runs, for cases this CPU machine cannot produce for real."""

from __future__ import annotations

import json
from pathlib import Path

from ddpdoctor.analysis import diagnose
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import load_run
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


def test_a_never_trained_parameter_points_at_the_line_that_hides_it(tmp_path: Path) -> None:
    # find_unused_parameters=True is set where the model is wrapped: the DDP constructor's
    # record names that line, and the warning points there, with the parameter's name.
    site = {"id": 0, "file": "/job/train.py", "line": 34, "func": "main"}
    model = {"module": "Model", "param_names": ["body.weight", "aux_head.weight"], "site": 0}
    model["options"] = {"find_unused_parameters": True}
    for rank in (0, 1):
        records = [
            ["header", {"schema": "ddpdoctor.trace/1", "rank": rank, "world_size": 2, "wall_ns": 0}],
            ["site", 5, 0, -1, site],
            ["ddp_init", 10, 100, -1, model],
        ]
        for step in range(6):
            t = 1000 + 1000 * step
            unused = {"params": [1], "used_on_ranks": [0], "scope": "global", "model": 0}
            records += [["forward", t, 100, step, 1, 1, 3 + step, -1], ["backward", t + 200, 300, step]]
            records.append(["unused", t + 500, 0, step, unused])
        records.append(["end", 99_000, 0, -1, {"reason": "exit"}])
        lines = "\n".join(json.dumps(r) for r in records)
        (tmp_path / f"trace-rank{rank}.jsonl").write_text(lines + "\n")
    (f,) = [f for f in diagnose(load_run([tmp_path])).findings if f.kind == "unused_parameters"]
    assert f.severity == "warning" and f.details["never_trained"] == ["aux_head.weight"]
    assert "find_unused_parameters=True (set where the model is wrapped, at train.py:34)" in f.summary
    assert f.details["place"] == "train.py:34" and "remove them" in f.fix


def test_a_set_epoch_no_pass_follows_is_a_replay_and_one_before_the_pass_is_read_is_not() -> None:
    """itertools.cycle(loader): one pass of 16 batches read in the first 16 steps, set_epoch(1..3)
    after it, 48 more steps: a replay. Lightning sets the epoch after the pass began, before its
    first batch: nothing. Nor is a set_epoch after the last step (a checkpoint's next epoch)."""
    import numpy as np

    from ddpdoctor.trace.columns import Events

    def run_with(after_read_ms: list[float], reads: int = 16) -> list:
        """set_epoch(1, 2...) at these ms after the last batch read (negative: before it)."""
        run = simulate_run(world=2, steps=64)
        for trace in run.ranks.values():
            w = trace.kind(schema.DATA_WAIT)
            keep = np.asarray(w.step) < reads
            fields = [w.fields[i] for i in np.flatnonzero(keep)]
            trace.events[schema.DATA_WAIT] = Events(w.ts[keep], w.dur[keep], w.step[keep], fields)
            info = {"id": 1, "sampler_id": 7, "sampler": "DistributedSampler", "shuffle": True, "epoch": 0}
            info.update(batches=16, batch_size=8, dataset_len=256, site="train.py:84")
            trace.meta[schema.LOADER] = [(0, -1, info)]
            last = int((w.ts + w.dur)[keep].max())
            fwd = trace.kind(schema.FORWARD)
            at = [max(1, last + int(ms * 1e3)) for ms in after_read_ms]
            step = [int(np.searchsorted(fwd.ts, t)) - 1 for t in at]
            sets = [{"sampler_id": 7, "epoch": e + 1, "site": "train.py:87"} for e in range(len(at))]
            trace.meta[schema.SET_EPOCH] = list(zip(at, step, sets, strict=True))
        return [f for f in diagnose(run).findings if f.kind == "missing_set_epoch"]

    (found,) = run_with([1, 500, 1000])
    assert found.severity == "warning" and found.details["epochs_unread"] == [1, 2, 3]
    assert found.details["place"] == "train.py:84" and "itertools.cycle" in found.summary
    assert run_with([-1e6]) == []  # set before the pass's first batch was read
    assert run_with([1e6]) == []  # after the last step
    assert run_with([1], reads=64) == []  # the loader went on being read
