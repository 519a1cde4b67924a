"""The pathology zoo under the real CLI: each case's diagnosis must match the expectation the
script declares (kind, root rank, place, fix keyword), and healthy twins must stay quiet.

CI runs a representative subset (one per family of cause, a healthy twin, one framework case);
`ZOO_ALL=1` runs every case here, and benchmarks/diagnosis_accuracy.py runs them all with a table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import EXIT_ABORT, REPO, diagnose_proc

_spec = importlib.util.spec_from_file_location(
    "diagnosis_accuracy", REPO / "benchmarks" / "diagnosis_accuracy.py"
)
assert _spec and _spec.loader
zoo = importlib.util.module_from_spec(_spec)
sys.modules["diagnosis_accuracy"] = zoo
_spec.loader.exec_module(zoo)

CI_SUBSET = (
    "healthy_basic",  # no warning on a healthy job
    "uneven_exit",  # uneven inputs, the survivor's error a consequence
    "early_return",  # a rank leaving early mid-pass
    "mismatch_size",  # different sizes at one collective, with both call sites
    "branch_barrier_hang",  # a hang: the rank-only barrier, killed after --hang-timeout
    "rank_forward_train",  # a rank-only forward that does not hang
    "accelerate_healthy",  # a framework's own sharding is sharding
    "never_init",  # no trace at all: the supervisor's records name the rank that never started
    "branch_metrics_allreduce",  # a rank aborted inside a collective its peer never issued
    "loader_worker_killed",  # a cause chained under the error the rank raised (its record's text)
    "hang_early_stop_local_heldout",  # a per-rank early stop: its break, not uneven inputs
    "mismatch_val_meter_dtype_heldout",  # aborted inside: the dtype its probe wrote before the call
    "healthy_zero_consolidate_all_ranks_heldout",  # ZeRO's inner step is not the step: no divergence
    "mismatch_contrastive_gather_heldout",  # an all_gather gloo refused: the rank whose count changed
    "healthy_unfreeze_rewrap_heldout",  # re-wrapped after unfreezing: the new wrapper is what syncs
    "shard_validate_exit2_heldout",  # sys.exit(2), no traceback: its status, its line, its words
    "hang_lazy_centroids_forward_heldout9",  # blocked in its own forward code: that rank, that line
    "uneven_repeat_factor_shard_sampler_heldout12",  # out of data behind longer passes: not a break
    "hang_final_eval_audit_heldout14",  # an extra all_reduce paired silently: that call, not the barrier
    "divergence_plateau_house_prices_heldout14",  # a scheduler stepped on each rank's own loss: its line
    "order_load_max_segment_heldout16",  # meters synced in each rank's own order: the max() behind it
    "mismatch_domain_window_report_heldout17",  # an all_reduce gloo let through: the rank whose count changed
    "hang_metrics_writer_join_heldout17",  # a queue.join() on a thread that died: the thread and its error
    "hang_rare_recall_skip_heldout17",  # an early return went past an all_reduce every round made
    "early_loss_guard_return_heldout18",  # a return between forward and backward, no DataLoader: not uneven
    "hang_task_meters_first_seen_order_heldout19",  # each meter's own method from one loop line: an order
    "misuse_cycle_replays_sampler_epoch_heldout19",  # itertools.cycle(loader): set_epoch with no new pass
    "healthy_reiter_on_stopiteration_heldout20",  # set_epoch, then iter(loader) again: a new pass, no replay
    "hang_plankton_prototype_gather_skip_heldout21",  # went past a call, into its gradient all-reduce
    "silent_genre_resume_set_epoch_once_heldout21",  # set_epoch once, before the loop: that call's line
    "hang_radar_nowcast_heldout22",  # a rank-0 barrier inside the loop, no DataLoader: not uneven inputs
    "rank_only_collective_audio_tagging_heldout23",  # a helper's all_reduce from a rank-0 branch: rank 0
    "weights_diverged_legal_clauses_heldout23",  # a copy_ on rank 0 after wrapping: the call and its line
    "collective_mismatch_ocr_lines_heldout23",  # sizes differ at one line: where the tensor was made
    "uneven_inputs_click_through_heldout23",  # shards made by hand: the lines that made them
    "hang_protein_heldout24",  # a helper's broadcast under a test of its own data: the rank that took it
    "diverge_galaxy_heldout24",  # rank 0's EMA swap in the loop: the statements that write the weights
    "uneven_traffic_heldout24",  # a list filled in a loop over the rank's detectors: the sharding line
    "hang_turbine_heldout25",  # a barrier made on schedule that one rank went past: not uneven inputs
    "uneven_fraud_heldout25",  # files split by rank, loaded by a helper: the line that split them
    "noshuffle_molecule_heldout25",  # no set_epoch: the epoch loop where the call goes
    "mismatch_landcover_heldout25",  # bincount(y) sized by each rank's labels: minlength in the fix
    "healthy_join_traffic_heldout25",  # Join's shadowed steps are not steps: no periodic rank work
    "periodic_keyword_heldout28",  # profiled while the others waited: the loop line of its work
    "divergence_reachpolicy_heldout29",  # gradients divided by a rank's own count: not a load, the division
    "divergence_char_lm_token_warmup_heldout15",  # lr written into param_groups from local counts: that write
    "divergence_intrusion_heldout29",  # a module's own buffer update, unsynced: the lerp_ that writes it
    "crash_birdsong_heldout30",  # raised in numpy's Cython: the user's line that called it
    "unused_steering_heldout30",  # a head whose output the loss reads only under an if: that if
    "unused_shipping_eta_heldout31",  # a head only predict_interval() uses: that method's line
)
CASES = {c.name: c for c in zoo.load_cases()}
SELECTED = sorted(CASES) if os.environ.get("ZOO_ALL") == "1" else list(CI_SUBSET)


def test_every_case_declares_a_well_formed_expectation() -> None:
    assert len(CASES) >= 24
    frameworks = [c.framework for c in CASES.values() if c.expect is not None]
    assert frameworks.count("lightning") >= 3 and frameworks.count("accelerate") >= 3
    assert sum(c.expect is None for c in CASES.values()) >= 5
    for case in CASES.values():
        if case.expect is not None:
            assert {"kind", "rank", "fix", "options"} <= set(case.expect), case.name


def test_judge_tells_right_from_wrong() -> None:
    """The scoring itself: a finding of another kind, rank, place or fix is wrong."""
    case = CASES["early_return"]
    good = {
        "kind": "rank_left_early",
        "severity": "error",
        "ranks": [1],
        "summary": f"left at {case.places[0]}",
        "fix": "keep every rank in the loop",
        "details": {"root_rank": 1},
    }
    assert zoo.judge(case, {"findings": [good]})[0]
    for change in ({"kind": "rank_failure"}, {"details": {"root_rank": 0}}, {"summary": "x"}, {"fix": "?"}):
        assert not zoo.judge(case, {"findings": [{**good, **change}]})[0], change
    healthy = CASES["healthy_basic"]
    assert zoo.judge(healthy, {"findings": [{**good, "severity": "info"}]})[0]
    assert not zoo.judge(healthy, {"findings": [good]})[0]


def _run_case(case: Any, tmp_path: Path) -> tuple[dict[str, Any] | None, int | None, str]:
    """zoo.run_case, once more when gloo aborted a rank at interpreter exit (conftest's
    EXIT_ABORT, pytorch/pytorch#179291): torch's race after the job's work was done, which the
    doctor reports as the death it is, not something the case is about."""
    diag, code, error = zoo.run_case(case, tmp_path)
    out = tmp_path / "job.out"
    if code not in (0, None) and out.exists() and EXIT_ABORT in out.read_text(errors="replace"):
        print(f"{tmp_path.name}: the job aborted at exit ({EXIT_ABORT!r}); once more", file=sys.stderr)
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        diag, code, error = zoo.run_case(case, tmp_path)
    return diag, code, error


@pytest.mark.e2e
@pytest.mark.parametrize("name", SELECTED)
def test_zoo_case(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    diag, code, error = _run_case(case, tmp_path)
    assert diag is not None, error
    right, why, got = zoo.judge(case, diag)
    assert right, f"{name}: {why} (found: {got})"
    if case.expect is None:
        assert code == 0
    if code == 124:  # `--on-hang kill` stopped it: the summary says the same code
        assert diag["run"]["exit_code"] == 124


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["monitored_barrier_timeout", "uneven_exit"])
def test_zoo_case_across_two_nodes(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank on a node of its own (two launchers, two doctors), judged from both run dirs.
    Across nodes nobody stops the rank the others waited for before it raises too, and the node
    whose rank finished waits in torchrun's exit barrier until interrupted."""
    monkeypatch.setattr(zoo, "NODES", [2])
    case = CASES[name]
    diag, code, error = zoo.run_case(case, tmp_path)
    assert diag is not None, error
    right, why, got = zoo.judge(case, diag)
    assert right, f"{name} on two nodes: {why} (found: {got})"


UNTIMED = ("branch_metrics_allreduce", "straggler", "divergence_dead_unit_revival_heldout")


@pytest.mark.e2e
@pytest.mark.parametrize("name", UNTIMED)
def test_zoo_case_with_buckets_untimed(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DDPDOCTOR_BUCKET_TIMING=off, no bucket record at all: the rank-only all_reduce is still
    placed among DDP's gradient all-reduces (their sequence numbers), the straggler is measured
    by its time in backward, and the divergence made after the last scheduled fingerprint is
    caught as the wrapper goes (main() returns; no timing hook keeps it alive)."""
    monkeypatch.setenv("DDPDOCTOR_BUCKET_TIMING", "off")
    case = CASES[name]
    diag, code, error = _run_case(case, tmp_path)
    assert diag is not None, error
    right, why, got = zoo.judge(case, diag)
    assert right, f"{name} untimed: {why} (found: {got})"


def test_diagnose_json_prints_an_error_object_when_nothing_can_be_read(tmp_path: Path) -> None:
    proc = diagnose_proc(tmp_path)
    assert proc.returncode == 2
    out = json.loads(proc.stdout)
    assert out["error"] and out["findings"] == [] and out["run"]["run_dirs"] == [str(tmp_path)]


@pytest.mark.e2e
def test_a_sync_skipped_on_another_group_is_named_from_each_ranks_own_order(tmp_path: Path) -> None:
    """Held-out set 18: rank 1's except skips an all_reduce on a separate metrics group; rank 0
    waits in that group's #3, rank 1 in the default group's gradient all-reduce. Neither side
    is ordered by the other group's numbers: no uneven inputs on the waiting rank, no "already
    issued it". Each rank's own order of calls across groups is: 8 gradient all-reduces, then
    the metrics call, three epochs running; rank 1 went past it, and is the root. The hang
    names each side with its group, as the cause's consequence."""
    diag, code, error = _run_case(CASES["hang_fault_recall_quiet_day_heldout18"], tmp_path)
    assert diag is not None, error
    assert code == 124
    kinds = [f["kind"] for f in diag["findings"] if f["severity"] == "error"]
    assert kinds == ["rank_only_collective", "hang"], diag["findings"]
    cause = diag["findings"][0]
    (place,) = CASES["hang_fault_recall_quiet_day_heldout18"].places
    assert cause["details"]["root_rank"] == 1 and cause["details"]["place"] == place, cause
    assert (
        "in each of 3 earlier round(s), every rank made that call after 8 gradient all-reduce(s)"
        in " ".join(cause["summary"].split())
    )
    (hang,) = [f for f in diag["findings"] if f["kind"] == "hang"]
    said = " ".join(hang["summary"].split())
    assert hang["details"]["pattern"] == "groups_apart", hang
    assert "of process group" in said and "of the default group" in said and "already issued" not in said
    assert said.startswith("(a consequence of rank_only_collective on rank 1)"), said
