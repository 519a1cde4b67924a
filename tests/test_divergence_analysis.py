"""The divergence analysis on synthetic runs: who differs, since when, why (analysis/misuse/divergence.py)."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor.analysis import diagnose
from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import load_run
from ddpdoctor.trace.synthetic import SyntheticJob, append_records, write_run

NAMES = ["body.weight", "body.bias", "bn.running_mean", "bn.running_var"]


def _run(tmp_path: Path, ranks: int, values, extra=None, names=NAMES, n_params=2, versions=None, grads=None):
    """A synthetic run whose ranks wrote fingerprints: ``values(rank, step) -> list``, checks at
    init, after steps 0, 63 and 127; ``extra(rank) -> [records]`` for more records;
    ``versions(rank, step) -> list``, the parameters' version counters (none: a run before them);
    ``grads(rank, step) -> list``, their gradients' likewise."""
    (run_dir,) = write_run(SyntheticJob(ranks=ranks, steps=130), tmp_path / "run")
    for rank in range(ranks):
        lines = []
        for i, (step, at) in enumerate(((-1, "init"), (0, "step"), (63, "step"), (127, "step"))):
            info = {"model": 0, "at": at, "values": values(rank, step)}
            if versions is not None:
                info["versions"] = versions(rank, step)
            if grads is not None:
                info["grad_versions"] = grads(rank, step)
            if i == 0:
                info.update(names=names, n_params=n_params, numels=[64] * len(names))
            lines.append([schema.FINGERPRINT, 10_000 + 1000 * (step + 1), 0, step, info])
        lines += extra(rank) if extra else []
        append_records(RunDir(run_dir).trace(rank), lines)
    return diagnose(load_run([run_dir]))


def _mine(diag) -> list:
    kinds = ("weights_diverged", "gradients_not_synced", "buffers_differ")
    return [f for f in diag.findings if f.kind in kinds]


def test_identical_replicas_say_nothing(tmp_path: Path) -> None:
    assert _mine(_run(tmp_path, 3, lambda r, s: [s + 10, s + 20, 5, 6])) == []


def test_the_rank_that_drifts_is_named_with_the_step_and_its_parameter(tmp_path: Path) -> None:
    diag = _run(tmp_path, 3, lambda r, s: [s + 10 + (r == 2 and s >= 63), s + 20, 5, 6])
    (f,) = _mine(diag)
    assert f.kind == "weights_diverged" and f.severity == "error" and f.ranks == [2]
    d = f.details
    assert d["parameters"] == ["body.weight"] and d["root_rank"] == 2 and d["since_step"] == 63
    assert d["per_parameter"]["body.weight"]["last_equal_step"] == 0
    assert d["cause"] == "diverged_during_training" and d["ranks_by_value"] == [[0, 1], [2]]
    assert "since step 63" in f.summary and "body.weight (64 elements)" in f.summary


def test_the_rank_whose_version_counters_moved_more_is_the_root_of_a_drift(tmp_path: Path) -> None:
    """Two ranks part at step 63: with two, the fingerprints alone cannot say which side is odd.
    Both ran the same optimizer steps (a move per step), and rank 1 wrote body.weight in place
    three more times: it is the root. Counters that moved alike, or none recorded, name no one."""

    def drifts(r: int, s: int) -> list:
        return [s + 10 + (r == 1 and s >= 63), s + 20 + (r == 1 and s >= 63), 5, 6]

    def moved(extra: int):
        return lambda r, s: [s + 1 + (extra if r == 1 and s >= 63 else 0), s + 1]

    (f,) = _mine(_run(tmp_path / "a", 2, drifts, versions=moved(3)))
    assert f.ranks == [1] and f.details["root_rank"] == 1 and f.details["cause"] == "written_on_rank", f
    said = " ".join(f.summary.split())
    assert (
        "rank(s) 1 wrote 1 of them in place beyond the optimizer steps every rank took, and rank(s) 0 did not"
        in said
    )
    assert "the optimizer steps account for: 3 on rank 1)" in said, said
    # Both ranks wrote, each its own number of times: neither is the root.
    both = _run(tmp_path / "d", 2, drifts, versions=lambda r, s: [s + 1 + (r + 1 if s >= 63 else 0), s + 1])
    (f,) = _mine(both)
    assert f.ranks == [0, 1] and f.details["root_rank"] is None and f.details["cause"] == "written_on_rank"
    assert "every rank wrote 1 of them in place beyond its optimizer steps" in " ".join(f.summary.split())
    # Counters that moved alike: no rank wrote them, the steps parted them (other gradients or
    # optimizer state); none recorded: nothing more is known.
    for case, versions, cause in (("b", moved(0), "stepped_apart"), ("c", None, "diverged_during_training")):
        (f,) = _mine(_run(tmp_path / case, 2, drifts, versions=versions))
        assert f.ranks == [0, 1] and f.details["root_rank"] is None, f
        assert f.details["cause"] == cause, f


def test_buffers_broadcast_every_forward_may_differ_between_forwards(tmp_path: Path) -> None:
    assert _mine(_run(tmp_path, 2, lambda r, s: [s, s, 5 + r * (s >= 0), 6 + r * (s >= 0)])) == []


def test_weights_loaded_after_wrapping_on_one_rank_name_the_line(tmp_path: Path) -> None:
    def extra(rank: int) -> list:
        if rank != 1:
            return []
        site = {"id": 0, "file": "/job/train.py", "line": 22, "func": "main"}
        load = {"target": "model", "class": "Net", "site": 0, "model": 0}
        return [[schema.SITE, 10_500, 0, -1, site], [schema.LOAD_STATE, 10_600, 0, -1, load]]

    diag = _run(tmp_path, 2, lambda r, s: [s + (r == 1 and s >= 0), s, 5, 6], extra)
    (f,) = _mine(diag)
    assert f.ranks == [1] and f.details["root_rank"] == 1 and f.details["since_step"] == 0
    assert f.details["cause"] == "weights_loaded_after_wrapping" and f.details["place"] == "train.py:22"
    assert "before wrapping" in f.fix and diag.has_errors


def test_a_thousand_parameters_one_differs(tmp_path: Path) -> None:
    names = [f"layers.{i}.weight" for i in range(1500)]

    def values(rank: int, step: int) -> list:
        v = list(range(step, step + 1500))
        v[977] += rank == 3 and step >= 127
        return v

    (f,) = _mine(_run(tmp_path, 4, values, names=names, n_params=1500))
    assert f.details["parameters"] == ["layers.977.weight"] and f.ranks == [3]
    assert f.details["since_step"] == 127


def test_a_reduction_that_never_finished_makes_divergence_a_consequence(tmp_path: Path) -> None:
    """Unused parameters without find_unused_parameters: DDP never finishes step 0's all-reduce,
    each rank steps with its own gradients; the cause is unused_parameters, not a load."""

    def extra(rank: int) -> list:
        return [[schema.UNUSED, 10_900, 0, 0, {"params": [0], "used_on_ranks": None, "scope": "local"}]]

    diag = _run(tmp_path, 2, lambda r, s: [s + r * (s >= 0), s, 5, 6], extra)
    (f,) = _mine(diag)
    assert f.severity == "info" and f.details["cause"] == "gradients_not_reduced"
    assert f.summary.startswith("(a consequence of unused_parameters)")


def _settings(rank: int, step: int, lr: float, by: str, site: int | None = None) -> list:
    info = {"optimizer": 0, "type": "SGD", "by": by, "groups": [{"lr": lr, "momentum": 0.9}]}
    if site is not None:
        info["site"] = site
    return [schema.OPT_SETTINGS, 10_000 + 1000 * (step + 1) + 10, 0, step, info]


def _scheduled(cut_at: dict[int, int]):
    """Each rank notes lr 0.1 at its first check and, where ``cut_at`` says, its scheduler's cut
    to 0.05 after that step (at train.py:40)."""

    def extra(rank: int) -> list:
        site = {"id": 3, "file": "/job/train.py", "line": 40, "func": "fit"}
        out = [[schema.SITE, 10_500, 0, -1, site], _settings(rank, 0, 0.1, "check")]
        if rank in cut_at:
            out.append(_settings(rank, cut_at[rank], 0.05, "scheduler", site=3))
        return out

    return extra


def test_a_learning_rate_cut_at_different_steps_is_the_cause_with_the_schedulers_line(tmp_path: Path) -> None:
    # Rank 0's scheduler cut the rate after step 80, rank 1's after step 100: between two checks
    # (63, 127), so only the scheduler's own notes show the ranks apart.
    diag = _run(tmp_path, 2, lambda r, s: [s + (r == 1 and s >= 127), s, 5, 6], _scheduled({0: 80, 1: 100}))
    (f,) = _mine(diag)
    d = f.details
    assert d["cause"] == "optimizer_settings_differ" and d["place"] == "train.py:40"
    assert d["setting"] == {"name": "lr", "step": 80, "values": [(0.05, [0]), (0.1, [1])]}
    assert "learning rate (lr) was 0.05 on rank(s) 0, 0.1 on rank(s) 1 after step 80" in f.summary
    assert "the same on every rank at step 63" in f.summary and "ReduceLROnPlateau" in f.fix


def test_a_learning_rate_cut_on_every_rank_at_once_is_no_cause(tmp_path: Path) -> None:
    diag = _run(tmp_path, 2, lambda r, s: [s + (r == 1 and s >= 127), s, 5, 6], _scheduled({0: 80, 1: 80}))
    (f,) = _mine(diag)
    assert f.details["cause"] == "diverged_during_training" and f.details["setting"] is None


def test_settings_changed_by_hand_are_compared_at_the_checks_every_rank_took(tmp_path: Path) -> None:
    # Rank 1 set its own momentum by hand: seen at the check after step 63. Rank 0 noted a change
    # at a check of its own (step 31) that rank 1 did not take: not a step to compare at.
    def extra(rank: int) -> list:
        notes = [_settings(rank, 0, 0.1, "check")]
        if rank == 0:
            notes.append(_settings(rank, 31, 0.2, "check"))
            notes.append(_settings(rank, 63, 0.2, "check"))
        else:
            notes.append(_settings(rank, 63, 0.2, "check"))
            notes[-1][4]["groups"][0]["momentum"] = 0.5
        return notes

    (f,) = _mine(_run(tmp_path, 2, lambda r, s: [s + (r == 1 and s >= 63), s, 5, 6], extra))
    assert f.details["cause"] == "optimizer_settings_differ"
    assert f.details["setting"]["name"] == "momentum" and f.details["setting"]["step"] == 63


HAND = """\
def main(model, rank, shard, cfg):
    if rank == 0:
        cfg.update(sweep())
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    for step in range(100):
        if rank == 1 and step == 50:
            for group in opt.param_groups:
                group["momentum"] = 0.5
        cfg["lr"] = 0.3
"""


def test_a_setting_no_scheduler_changed_is_placed_at_the_scripts_line_that_set_it(tmp_path: Path) -> None:
    """Held-out sets 15-19: a setting changed by hand (`group["momentum"] = 0.5` in a loop over
    param_groups) is placed at that write, not at a dict's key of the same name; one the ranks
    had from the start at the keyword given to the optimizer, and at what changed its value
    under an ``if`` on the rank (a sweep's config on rank 0)."""
    script = tmp_path / "train.py"
    script.write_text(HAND)
    site = [schema.SITE, 10_500, 0, -1, {"id": 7, "file": str(script), "line": 5, "func": "main"}]

    def later(rank: int) -> list:
        notes = [site, _settings(rank, 0, 0.1, "check"), _settings(rank, 63, 0.1, "check")]
        notes[-1][4]["groups"][0]["momentum"] = 0.5 if rank == 1 else 0.9
        return notes

    (f,) = _mine(_run(tmp_path / "a", 2, lambda r, s: [s + (r == 1 and s >= 63), s, 5, 6], later))
    assert f.details["cause"] == "optimizer_settings_differ" and f.details["place"] == "train.py:8", f.summary
    assert "written at train.py:8 (`group['momentum'] = 0.5`)" in f.summary and f.fix.startswith(
        "Start at train.py:8."
    )

    def start(rank: int) -> list:
        return [site, _settings(rank, 0, 0.1 if rank == 0 else 0.3, "check")]

    (f,) = _mine(_run(tmp_path / "b", 2, lambda r, s: [s + (r == 1 and s >= 0), s, 5, 6], start))
    given = "given to SGD() at train.py:4 (`lr=cfg['lr']`), "
    assert given + "train.py:3 (`cfg.update(sweep())`, under `if rank == 0:`)" in f.summary
    assert f.details["place"] == "train.py:3", f.details
    # A written value worked out above the write: that line too (parsed files are cached by
    # path: the script in another directory).
    (tmp_path / "c").mkdir()
    other = tmp_path / "c" / "train.py"
    other.write_text(
        HAND.replace('group["momentum"] = 0.5', 'group["momentum"] = m').replace(
            "        if rank == 1", "        m = 0.5 + rank / 10\n        if rank == 1"
        )
    )
    site[4] = {**site[4], "file": str(other)}
    (f,) = _mine(_run(tmp_path / "c" / "run", 2, lambda r, s: [s + (r == 1 and s >= 63), s, 5, 6], later))
    assert "(`group['momentum'] = m`, from train.py:6 `m = 0.5 + rank / 10`)" in f.summary, f.summary


def test_an_optimizer_freed_is_compared_no_later_than_its_first_rank_freed_it(tmp_path: Path) -> None:
    # The collector freed rank 0's old optimizer at step 40 and rank 1's at step 80, each noting
    # its last settings then: at the check after step 63 they are not compared (rank 1's note
    # there is older than rank 0's).
    def extra(rank: int) -> list:
        notes = [_settings(rank, 0, 0.1, "check"), _settings(rank, 40 if rank == 0 else 80, 0.05, "gone")]
        return notes

    (f,) = _mine(_run(tmp_path, 2, lambda r, s: [s + (r == 1 and s >= 127), s, 5, 6], extra))
    assert f.details["cause"] == "diverged_during_training"


def test_steps_are_lined_up_by_the_first_gradient_all_reduce_each_begins_with() -> None:
    """Under Join rank 1's count stood still while it shadowed the all-reduces that began rank 0's
    steps 2 and 3: its own step 2 began with the all-reduce of the fifth step every rank shares."""
    import numpy as np

    from ddpdoctor.analysis.misuse.fingerprints import Aligned

    firsts = {
        0: (np.array([0, 1, 2, 3]), np.array([10, 14, 18, 22])),
        1: (np.array([0, 1, 2]), np.array([10, 14, 26])),
    }
    aligned = Aligned(firsts, {0: 25, 1: 29})
    assert [aligned.step(0, s) for s in range(5)] == [0, 1, 2, 3, -1]
    assert [aligned.step(1, s) for s in range(4)] == [0, 1, 4, -1]
    assert aligned.step(7, 0) == -1 and aligned.last(0, -1) == 3 and aligned.last(1, -1) == 4
    assert aligned.last(7, 9) == 9


def test_the_rank_that_wrote_its_reduced_gradients_is_the_root(tmp_path: Path) -> None:
    """Held-out set 23: rank 0 clipped its gradients in a rank-0 logging helper, after DDP's
    all-reduce, and stepped with them; both ranks ran the same optimizer steps, so the weights'
    version counters moved alike. The gradients' counters did not, at the check that fell on a
    clipped step: rank 0's moved once more (the clip's mul_). Counters alike say nothing."""

    def drifts(r: int, s: int) -> list:
        return [s + 10 + (r == 0 and s >= 63), s + 20 + (r == 0 and s >= 63), 5, 6]

    def clipped(r: int, s: int) -> list:
        return [1 + (r == 0 and s == 63), 1 + (r == 0 and s == 63)]

    (f,) = _mine(_run(tmp_path / "a", 2, drifts, versions=lambda r, s: [s + 1, s + 1], grads=clipped))
    assert f.ranks == [0] and f.details["root_rank"] == 0, f
    assert f.details["cause"] == "gradients_written_on_rank"
    said = " ".join(f.summary.split())
    assert "rank(s) 0 wrote their gradients in place after DDP's all-reduce (step 63" in said, said
    assert "get_total_norm" in f.fix
    (f,) = _mine(
        _run(tmp_path / "b", 2, drifts, versions=lambda r, s: [s + 1, s + 1], grads=lambda r, s: [1, 1])
    )
    assert f.details["root_rank"] is None and f.details["cause"] == "stepped_apart"
