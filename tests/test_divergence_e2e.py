"""Replicas that disagree, found in real torchrun jobs (2 ranks, gloo); healthy twins stay quiet."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    JOBS,
    REPO,
    diagnose_json,
    diagnose_proc,
    free_port,
    job_env,
    read_lines,
    run_doctor,
    torchrun,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import schema

pytestmark = pytest.mark.e2e
ZOO = REPO / "tests" / "zoo"


def _fingerprints(run_dir: Path, rank: int) -> list[tuple[int, dict]]:
    lines = read_lines(RunDir(run_dir).trace(rank))
    return [(line[3], line[4]) for line in lines if line[0] == schema.FINGERPRINT]


def test_weights_loaded_after_wrapping_are_an_error_with_rank_step_cause_and_fix(tmp_path: Path) -> None:
    """The issue's reproduction: rank 0 loads weights into ddp.module after wrapping."""
    job = run_doctor(tmp_path, torchrun(2, ZOO / "weights_loaded_after_wrap.py"))
    assert job.returncode == 0, job.stderr  # the job itself succeeds, as without ddpdoctor
    out = " ".join(job.stderr.split())  # the closing summary, unwrapped
    assert "ERROR weights_diverged [rank 0]" in out and "No problems found" not in out
    assert "0.weight (512 elements)" in out and "2.bias (4 elements)" in out
    assert "since step 0" in out and "loaded weights after wrapping" in out
    assert "weights_loaded_after_wrap.py:22" in out and "before wrapping" in out

    proc = diagnose_proc(job.run_dir)
    assert proc.returncode == 1  # an error finding
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "weights_diverged"]
    assert f["severity"] == "error" and f["ranks"] == [0] and f["details"]["root_rank"] == 0
    assert f["details"]["parameters"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert f["details"]["since_step"] == 0 and f["details"]["cause"] == "weights_loaded_after_wrapping"
    assert all(p["still_differs"] for p in f["details"]["per_parameter"].values())  # to the end


def test_gradients_that_never_sync_are_named_with_their_size_and_cause(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, JOBS / "divergence.py", "not_synced"))
    assert job.returncode == 0, job.stderr
    found = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "gradients_not_synced"]
    by_cause = {f["details"]["cause"]: f for f in found}
    assert set(by_cause) == {"requires_grad_after_wrapping", "added_after_wrapping", "outside_ddp"}
    unfrozen = by_cause["requires_grad_after_wrapping"]
    assert unfrozen["details"]["numels"] == {"head.weight": 128, "head.bias": 4}
    assert "head.weight (128 elements)" in unfrozen["summary"] and "requires_grad" in unfrozen["fix"]
    assert by_cause["added_after_wrapping"]["details"]["parameters"] == ["scale"]
    assert by_cause["outside_ddp"]["details"]["numels"] == {
        "param_groups[0][5] [4, 16]": 64,
        "param_groups[0][6] [4]": 4,
    }
    for f in found:  # each rank trains them on its own batches: they drift apart at once
        assert f["severity"] == "error" and f["ranks"] == [0, 1] and f["details"]["since_step"] == 0
    # The registered body is all-reduced: it is not among the diverged weights.
    assert not [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "weights_diverged"]


def test_optimizer_steps_one_rank_skipped_name_it_as_the_root(tmp_path: Path) -> None:
    """Every collective matched, nothing raised: rank 1 alone skipped three optimizer steps.
    Its optimizer events say which; with two ranks the fingerprints alone cannot say who."""
    job = run_doctor(tmp_path, torchrun(2, JOBS / "divergence.py", "skip_steps"))
    assert job.returncode == 0, job.stderr
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "weights_diverged"]
    assert f["severity"] == "error" and f["ranks"] == [1] and f["details"]["root_rank"] == 1, f
    assert f["details"]["cause"] == "optimizer_steps_skipped", f
    assert "rank 1 skipped optimizer.step() at 3 step(s) the others took (3, 10, 17)" in f["summary"]
    assert "all_reduce a skip flag" in f["fix"]


def test_a_join_with_a_stateless_optimizer_is_healthy_though_the_step_counts_part(tmp_path: Path) -> None:
    """Uneven shards under DDP's Join, SGD without momentum, a check after every optimizer step:
    rank 0 shadows rank 1's four extra all-reduces each epoch, so in the second epoch rank 0's
    step N is rank 1's step N + 4. The replicas are equal at every moment they share; checks
    compared by the ranks' own step numbers compared different moments and cried divergence.
    They are lined up by the gradient all-reduce each step begins with."""
    job = run_doctor(tmp_path, torchrun(2, JOBS / "divergence.py", "join_sgd"), DDPDOCTOR_FINGERPRINT="1")
    assert job.returncode == 0, job.stderr
    found = diagnose_json(job.run_dir)["findings"]
    assert not [f for f in found if f["severity"] in ("error", "warning")], found
    steps = [[s for s, info in _fingerprints(job.run_dir, r) if info.get("at") == "step"] for r in (0, 1)]
    assert len(steps[0]) == 16 and len(steps[1]) == 24 and steps[0][-1] == 15, steps  # 8+8 and 12+12
    from ddpdoctor.analysis.misuse.fingerprints import collect
    from ddpdoctor.trace.reader import load_run

    (series,) = collect(load_run([job.run_dir])).values()
    exits = [[k for k in series.checks[r] if k[2] == "exit"] for r in (0, 1)]
    assert exits[0] == exits[1] == [(23, 2, "exit")], (
        exits
    )  # rank 0's final state is after rank 1's last step
    # `top` lines the checks up the same way: each step check in the status carries the sequence
    # number its step's first gradient all-reduce had (test_live.py compares by it)
    for rank in (0, 1):
        status = json.loads((job.run_dir / f"status-rank{rank}.json").read_text())
        seqs = [c["seq"] for c in status["fingerprints"] if c["at"] == "step"]
        assert seqs and all(isinstance(q, int) for q in seqs) and seqs == sorted(set(seqs)), status


def test_a_join_with_momentum_names_the_rank_whose_optimizer_fell_behind(tmp_path: Path) -> None:
    """The same with momentum 0.9: rank 0 reduced gradients 4 times an epoch without stepping, its
    momentum buffers fell behind, and after Join's re-sync the same averaged gradients move the
    replicas apart. Checked every step, the weights are seen apart at a step both ranks took. On
    the default interval (64) no check after the first falls on a step both took; the optimizer's
    steps and its settings (noted at that first check) still say it, as a warning."""
    job = run_doctor(
        tmp_path, torchrun(2, JOBS / "divergence.py", "join_momentum"), DDPDOCTOR_FINGERPRINT="1"
    )
    assert job.returncode == 0, job.stderr
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["severity"] in ("error", "warning")]
    assert f["kind"] == "weights_diverged" and f["details"]["cause"] == "optimizer_steps_skipped", f
    assert f["ranks"] == [0] and f["details"]["root_rank"] == 0, f
    said = " ".join(f["summary"].split())
    assert (
        "the ranks made the same 24 gradient all-reduce(s), but their optimizers took different numbers"
        in said
    )
    assert "(rank 0 16, the others 24)" in said and "Join" in f["fix"], said
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    job = run_doctor(sparse, torchrun(2, JOBS / "divergence.py", "join_momentum"))
    assert job.returncode == 0, job.stderr
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["severity"] in ("error", "warning")]
    assert f["kind"] == "optimizer_state_behind" and f["severity"] == "warning" and f["ranks"] == [0], f
    assert "Its optimizer keeps state (SGD (momentum 0.9))" in " ".join(f["summary"].split()), f


def test_weights_one_rank_wrote_right_after_wrapping_name_it_by_their_version_counters(
    tmp_path: Path,
) -> None:
    """Rank 0 copies new values into its head's weights under no_grad right after DDP's
    constructor (held-out set 22 injected pretrained vectors so): no load_state_dict to point at,
    and with two ranks no majority. The head's counter moved once more on rank 0 than the
    optimizer step accounts for, learnt from the intervals after it: rank 0 is the root."""
    job = run_doctor(tmp_path, torchrun(2, JOBS / "divergence.py", "copy_after"))
    assert job.returncode == 0, job.stderr
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "weights_diverged"]
    assert f["details"]["cause"] == "changed_after_wrapping" and f["details"]["root_rank"] == 0, f
    assert f["ranks"] == [0] and "head.weight" in f["details"]["parameters"], f
    assert "(rank(s) 0: the version counters moved beyond the optimizer step, 1 on rank 0)" in " ".join(
        f["summary"].split()
    )


def test_weights_one_rank_wrote_in_place_name_it_by_their_version_counters(tmp_path: Path) -> None:
    """Rank 1 alone puts its head's weights back to a saved copy under no_grad three times: every
    collective matched, every optimizer step was taken on both ranks. The head's two tensors'
    version counters moved three more times on rank 1 (the weight's only: the bias was not
    written), and the body, written alike, is no part of it."""
    job = run_doctor(tmp_path, torchrun(2, JOBS / "divergence.py", "rollback"))
    assert job.returncode == 0, job.stderr
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "weights_diverged"]
    assert (
        f["ranks"] == [1] and f["details"]["root_rank"] == 1 and f["details"]["cause"] == "written_on_rank"
    ), f
    said = " ".join(f["summary"].split())
    assert "rank(s) 1 wrote 1 of them in place beyond the optimizer steps every rank took" in said, said
    assert "account for: 3 on rank 1)" in said, said
    assert "head.weight" in said and "body.weight" not in f["details"]["parameters"], f
    source = (JOBS / "divergence.py").read_text().splitlines()
    call = next(i for i, text in enumerate(source, 1) if "step = train(" in text)
    write = next(i for i, text in enumerate(source, 1) if "copy_(saved)" in text)
    assert f["details"]["place"] == f"divergence.py:{call}", f  # the loop's call, into the write
    assert f"writing at divergence.py:{write}" in said and f"Start at divergence.py:{call}" in f["fix"], f
    versions = [info["versions"] for _, info in _fingerprints(job.run_dir, 1) if info.get("model") == 0]
    assert versions and all(isinstance(v, list) for v in versions)


def test_gradients_one_rank_clipped_after_their_all_reduce_name_it_by_their_version_counters(
    tmp_path: Path,
) -> None:
    """Rank 0 clips its gradients at every step, after DDP's all-reduce, for the norm its log
    wants; rank 1 does not. Both take every optimizer step, so the weights' counters move alike;
    the gradients' counters moved once more on rank 0 at every check (held-out set 23)."""
    job = run_doctor(tmp_path, torchrun(2, JOBS / "divergence.py", "clip_rank0"))
    assert job.returncode == 0, job.stderr
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "weights_diverged"]
    assert f["ranks"] == [0] and f["details"]["root_rank"] == 0, f
    assert f["details"]["cause"] == "gradients_written_on_rank", f
    assert "rank(s) 0 wrote their gradients in place after DDP's all-reduce" in " ".join(f["summary"].split())
    grads = [info.get("grad_versions") for _, info in _fingerprints(job.run_dir, 0) if info.get("model") == 0]
    assert any(isinstance(g, list) and g and min(g) >= 0 for g in grads), grads


def test_every_backward_under_no_sync_is_the_cause_and_the_lines_that_decide_it_are_named(
    tmp_path: Path,
) -> None:
    """An accumulation boundary test that never holds (held-out set 24): every backward runs
    under no_sync(), DDP reduces nothing, and each rank steps on its own gradients. The step
    count, which a forward after a synced one advances, never leaves step 0 while the optimizer
    steps: the cause, not a write after wrapping (which the weights' first difference, before
    the first step ended, looked like), and the script's lines that decide no_sync()."""
    job = run_doctor(tmp_path, torchrun(2, JOBS / "divergence.py", "never_synced"))
    assert job.returncode == 0, job.stderr
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "weights_diverged"]
    assert f["details"]["cause"] == "stepped_without_sync", f
    summary = " ".join(f["summary"].split())
    assert "no gradient all-reduce preceded" in summary and "rank(s) 0-1" in summary, summary
    source = (JOBS / "divergence.py").read_text().splitlines()
    test = next(i for i, text in enumerate(source, 1) if "the test never holds there" in text)
    assert f["details"]["place"] == f"divergence.py:{test}", f  # the with, its context, the test
    assert f"divergence.py:{test + 2} <- divergence.py:{test + 1} <- divergence.py:{test}" in summary
    assert "outside model.no_sync()" in f["fix"], f


def test_a_setting_written_by_hand_on_one_rank_is_the_cause_from_its_last_note(tmp_path: Path) -> None:
    """Rank 0 alone raises SGD's momentum in a fine-tune phase (held-out set 15). No scheduler
    changed it and no step check fell between, so the note its optimizer wrote as main()
    returned and freed it is what shows the ranks apart."""
    job = run_doctor(tmp_path, torchrun(2, ZOO / "divergence_denoiser_momentum_rank0_phase_heldout15.py"))
    assert job.returncode == 0, job.stderr
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "weights_diverged"]
    assert f["details"]["cause"] == "optimizer_settings_differ", f
    setting = f["details"]["setting"]
    assert setting["name"] == "momentum" and setting["values"] == [[0.95, [0]], [0.5, [1]]], f
    assert "no scheduler step on record changed it" in f["summary"] and "every rank" in f["fix"]
    notes = [line[4] for line in read_lines(RunDir(job.run_dir).trace(0)) if line[0] == schema.OPT_SETTINGS]
    assert notes[-1]["by"] == "gone" and notes[-1]["groups"][0]["momentum"] == 0.95


def test_a_scheduler_stepped_with_a_metric_every_rank_shares_is_no_cause(tmp_path: Path) -> None:
    """The twin: ReduceLROnPlateau fed an all-reduced accuracy cuts the rate at the same epoch on
    every rank; the scheduler's notes are on record, alike, and nothing is said."""
    job = run_doctor(tmp_path, torchrun(2, ZOO / "healthy_bearing_fault_plateau_global_acc_heldout15.py"))
    assert job.returncode == 0, job.stderr
    assert [f["kind"] for f in diagnose_json(job.run_dir)["findings"] if f["severity"] != "info"] == []
    noted = []
    for rank in (0, 1):
        lines = read_lines(RunDir(job.run_dir).trace(rank))
        noted.append(
            [
                (ln[3], ln[4]["groups"])
                for ln in lines
                if ln[0] == schema.OPT_SETTINGS and ln[4]["by"] == "scheduler"
            ]
        )
    assert noted[0] == noted[1] and len({str(g) for _, g in noted[0]}) >= 2  # at least one cut, alike


def test_weights_a_forward_changes_in_place_by_its_own_batch_name_the_forward(tmp_path: Path) -> None:
    """nn.Embedding(max_norm=...) renormalises, in place, the rows each rank's batch looked up
    (held-out set 17): the copies part from step 0 with every gradient all-reduced. The cause is
    the forward, from the version counters it moved, not weights loaded after wrapping."""
    job = run_doctor(tmp_path, torchrun(2, JOBS / "inplace_forward.py", "max_norm"))
    assert job.returncode == 0, job.stderr
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "weights_diverged"]
    assert f["details"]["parameters"] == ["table.weight"] and f["details"]["cause"] == "changed_in_forward", f
    said = " ".join(f["summary"].split())
    assert "the forward changes them in place, each rank by its own batch" in said, said
    assert "table.weight (Embedding(max_norm=1.0))" in said and "max_norm" in f["fix"], f
    assert "load" not in f["fix"].lower(), f["fix"]  # nothing was loaded


@pytest.mark.parametrize("mode", ["renorm_after", "clamp_in"])
def test_in_place_changes_alike_on_every_rank_say_nothing(tmp_path: Path, mode: str) -> None:
    """The twins: the whole table renormalised after each step on every rank, and a clamp in
    the forward that is the same everywhere (its change is on record; the replicas agree)."""
    job = run_doctor(tmp_path, torchrun(2, JOBS / "inplace_forward.py", mode))
    assert job.returncode == 0, job.stderr
    found = diagnose_json(job.run_dir)["findings"]
    assert [f["kind"] for f in found if f["severity"] != "info"] == [], found
    edited = [ln[4] for ln in read_lines(RunDir(job.run_dir).trace(0)) if ln[0] == schema.INPLACE]
    assert edited == (
        [{"model": 0, "params": ["head.weight"], "modules": {"head.weight": "Linear"}}]
        if mode == "clamp_in"
        else []
    )


@pytest.mark.parametrize(
    "script",
    [
        "ckpt_before",  # rank 0 loads before wrapping: the constructor's broadcast syncs it
        "bn_no_broadcast",  # BatchNorm statistics differ by rank: a note at most
        "autocast",  # bf16 autocast and gradient_as_bucket_view=True
        "zoo/lightning_healthy_sync_dist.py",
        "zoo/accelerate_healthy.py",
    ],
)
def test_healthy_twins_are_checked_and_stay_quiet(tmp_path: Path, script: str) -> None:
    if script.startswith("zoo/"):
        command = torchrun(2, REPO / "tests" / script)
    else:
        command = torchrun(2, JOBS / "divergence.py", script)
    job = run_doctor(tmp_path, command, CKPT_DIR=str(tmp_path))
    assert job.returncode == 0, job.stderr
    found = diagnose_json(job.run_dir)["findings"]
    assert [f["kind"] for f in found if f["severity"] != "info"] == []
    notes = {f["kind"] for f in found}
    assert ("buffers_differ" in notes) == (script == "bn_no_broadcast")
    for f in found:
        if f["kind"] == "buffers_differ":  # where the wrapper was built, in the torch's own words
            lines = (JOBS / "divergence.py").read_text().splitlines()
            wrapped = next(n for n, text in enumerate(lines, 1) if "model = DDP(net" in text)
            assert f"(wrapped at divergence.py:{wrapped})" in f["summary"], f
            renamed = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters  # torch 2.13
            knob = "forward_sync_buffers" if renamed else "broadcast_buffers"
            assert f"{knob}=False keeps each rank's own" in f["summary"] and f"{knob}=True" in f["fix"], f
    # Not silent for want of looking: every rank fingerprinted at construction and after step 0,
    # and the parameters (the buffers, under broadcast_buffers=False, may differ) agree.
    checks = [_fingerprints(job.run_dir, rank) for rank in (0, 1)]
    for rank_checks in checks:
        assert [info["at"] for _, info in rank_checks][:2] == ["init", "step"]
    first = checks[0][0][1]
    params = first["n_params"]
    for (s0, a), (s1, b) in zip(checks[0], checks[1], strict=True):
        assert s0 == s1 and a["at"] == b["at"] and a["values"][:params] == b["values"][:params]


def test_ranks_on_different_fingerprint_intervals_still_compare_their_final_weights(tmp_path: Path) -> None:
    """Two launchers standing for two nodes, one rank each, whose ranks check on different
    intervals (as ranks whose own step times chose them would): 64 checks the last step, 256
    does not. The ranks cut their learning rate at different epochs, after every check they
    share but the one at exit, which each rank takes whether or not it checked that step."""
    port, procs = free_port(), []
    for node, interval in ((0, "64"), (1, "256")):
        command = [
            sys.executable, "-m", "ddpdoctor", "run", "--out", f"n{node}", "--",
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
            "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
            str(ZOO / "divergence_plateau_house_prices_heldout14.py"),
        ]  # fmt: skip
        env = job_env(DDPDOCTOR_FINGERPRINT=interval)
        procs.append(subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE))
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-3000:]
    checks = [[(step, info["at"]) for step, info in _fingerprints(tmp_path / f"n{r}", r)] for r in (0, 1)]
    assert (127, "step") in checks[0] and (127, "step") not in checks[1]
    assert checks[0][-1] == checks[1][-1] == (127, "exit")
    diag = diagnose_json(tmp_path / "n0", tmp_path / "n1")
    assert [f["kind"] for f in diag["findings"] if f["severity"] == "error"] == ["weights_diverged"]
