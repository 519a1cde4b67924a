"""DDP misuse found in real torchrun jobs: each mistake found, healthy jobs left alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import JOBS, diagnose_json, job_env, read_lines, run_doctor, torchrun

pytestmark = pytest.mark.e2e


def findings(tmp_path: Path, *args: str, nproc: int = 2, script: str = "misuse.py") -> tuple[int, list]:
    job = run_doctor(tmp_path, torchrun(nproc, JOBS / script, *args))
    return job.returncode, diagnose_json(job.run_dir)["findings"]


def serious(found: list) -> list:
    return [f for f in found if f["severity"] in ("warning", "error")]


def test_unused_head_named_before_the_crash(tmp_path: Path) -> None:
    code, found = findings(tmp_path, "unused_head")
    assert code != 0  # DDP raises at the second forward, as it would without us
    (f,) = [f for f in found if f["kind"] == "unused_parameters"]
    assert f["severity"] == "error" and f["ranks"] == [0, 1]
    assert f["details"]["parameters"] == ["aux.bias", "aux.weight"]  # no "module." prefix
    assert f["details"]["steps"] == [0]
    assert f["details"]["ddp_error"] is True
    assert "find_unused_parameters=True" in f["fix"] and "stop computing" in f["fix"]


def test_branch_leaves_parameters_unused_on_some_steps(tmp_path: Path) -> None:
    code, found = findings(tmp_path, "branch")
    assert code == 0
    (f,) = [f for f in found if f["kind"] == "unused_parameters"]
    assert f["severity"] == "info"
    assert f["details"]["parameters"] == ["aux.bias", "aux.weight"]
    assert f["details"]["steps"] == [3, 7]
    assert serious(found) == []
    text = (JOBS / "misuse.py").read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if "self.aux(h) if use_aux" in t)
    said = " ".join(f["summary"].split())
    assert f"every use of self.aux (misuse.py:{line}) is under `self.aux(h) if use_aux else None`" in said, (
        said
    )
    call = next(i for i, t in enumerate(text, 1) if "use_aux=not (" in t)
    assert (
        "and `use_aux` is `not (mode == 'branch' and step in BRANCH_STEPS)` where the model is called" in said
    )
    assert f["details"]["place"] == f"misuse.py:{call}", f["details"]


def test_a_submodule_no_method_but_init_reads_is_named_with_the_forward(tmp_path: Path) -> None:
    """Held-out set 24's code model makes a position embedding and never adds it, under
    find_unused_parameters=True: never trained, and the forward that never reads it is named."""
    code, found = findings(tmp_path, script="../zoo/unused_codecompletion_heldout24.py")
    assert code == 0
    (f,) = [f for f in found if f["kind"] == "unused_parameters"]
    assert f["severity"] == "warning" and f["details"]["never_trained"] == ["pos_emb.weight"], f
    text = (JOBS.parent / "zoo" / "unused_codecompletion_heldout24.py").read_text().splitlines()
    forward = next(i for i, t in enumerate(text, 1) if "def forward(self, idx)" in t)
    made = next(i for i, t in enumerate(text, 1) if "self.pos_emb = " in t)
    said = " ".join(f["summary"].split())
    name = "unused_codecompletion_heldout24.py"
    never = f"CodeLM.forward ({name}:{forward}) never uses self.pos_emb, which __init__ makes at "
    never += f"{name}:{made}"
    assert never in said, said
    assert f["fix"].startswith(f"Use self.pos_emb in the forward ({name}:{forward}) or remove it."), f["fix"]


def test_find_unused_parameters_on_a_fully_used_model(tmp_path: Path) -> None:
    code, found = findings(tmp_path, "unneeded")
    assert code == 0
    (f,) = serious(found)
    assert f["kind"] == "find_unused_parameters_unneeded" and f["details"]["steps"] == 12
    assert f["details"]["graph_walk_ms"] > 0


def test_two_models_header_and_findings_name_the_same_model(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, JOBS / "misuse.py", "two_models"))
    assert job.returncode == 0, job.stderr
    header = [line.strip() for line in job.stderr.splitlines() if line.strip().startswith("DDP: ")]
    assert len(header) == 2
    assert header[0].startswith("DDP: Net (DDP model #0)")
    assert header[0].endswith("find_unused_parameters=False")
    assert header[1].startswith("DDP: Linear (DDP model #1)")
    assert header[1].endswith("find_unused_parameters=True")
    diag = diagnose_json(job.run_dir)
    assert [m["module"] for m in diag["run"]["ddp_models"]] == ["Net", "Linear"]
    (f,) = serious(diag["findings"])
    assert f["kind"] == "find_unused_parameters_unneeded" and f["details"]["models"] == [1]
    assert f["summary"].startswith("Linear (DDP model #1): find_unused_parameters=True")
    # 12 iterations, each through both models: 12 steps, not 24 (the first model sets the pace).
    forwards = [r for r in read_lines(job.run_dir / "trace-rank0.jsonl") if r[0] == "forward" and r[4] == 1]
    assert len(forwards) == 24 and sorted({r[3] for r in forwards}) == list(range(12))
    assert len([r for r in read_lines(job.run_dir / "trace-rank0.jsonl") if r[0] == "optimizer"]) == 12


def test_missing_distributed_sampler(tmp_path: Path) -> None:
    code, found = findings(tmp_path, "no_sampler")
    assert code == 0
    (f,) = serious(found)
    assert f["kind"] == "missing_distributed_sampler" and f["ranks"] == [0, 1]
    assert f["details"]["sampler"] == "RandomSampler" and f["details"]["dataset_len"] == 96
    # Judged by effect: each rank's pass gives 12 batches of 8, the whole 96-sample dataset.
    loop = f"misuse.py:{_line('misuse.py', 'for x, y in loader:')}"
    assert f["details"]["batches_per_rank"] == 12 and f["details"]["place"] == loop
    assert f["details"]["same_batches"] is True  # one seed everywhere: the same order on each rank


def test_missing_set_epoch(tmp_path: Path) -> None:
    code, found = findings(tmp_path, "no_set_epoch")
    assert code == 0
    (f,) = serious(found)
    assert f["kind"] == "missing_set_epoch"
    created = _line("misuse.py", "sampler = DistributedSampler(data, shuffle=True, seed=0)")
    epochs = f"misuse.py:{_line('misuse.py', 'for epoch in range(2):')}"
    assert f["details"] == {
        "epoch": 0,
        "passes": 2,
        "ranks": [0, 1],
        "place": epochs,  # where the call goes: the loop that begins each pass
        "loop": f"misuse.py:{_line('misuse.py', 'for x, y in loader:')}",
        "epoch_loop": epochs,
        "same_batches": True,  # each epoch began with the same batches, not only the same epoch
        "set_epoch_elsewhere": None,
    }
    assert f"created at misuse.py:{created}" in f["summary"]
    assert f"the loop at {epochs} (`for epoch in range(2):`) begins each pass and never calls" in f["summary"]
    assert f["fix"].startswith(f"Call sampler.set_epoch(epoch) first thing in the loop at {epochs}")


def test_set_epoch_on_another_sampler_names_both(tmp_path: Path) -> None:
    """The name reused for a validation sampler: set_epoch is called every epoch, on that one."""
    _, found = findings(tmp_path, "shadowed")
    (f,) = serious(found)
    train = _line("misuse.py", "sampler = DistributedSampler(data, shuffle=True, seed=0)")
    other = _line("misuse.py", "sampler = DistributedSampler(data, shuffle=False)")
    call = _line("misuse.py", "sampler.set_epoch(epoch)")
    said = " ".join(f["summary"].split())
    assert f["kind"] == "missing_set_epoch" and f"created at misuse.py:{train}" in said, said
    called = f"set_epoch was called at misuse.py:{call}, but on another DistributedSampler"
    assert f"{called} created at misuse.py:{other}" in said, said
    assert f["details"]["place"] == f"misuse.py:{train}" and "train_loader.sampler.set_epoch" in f["fix"]


def test_a_set_epoch_once_or_with_one_value_names_its_call(tmp_path: Path) -> None:
    """set_epoch was called, but not with each epoch: the finding names that call, the line to
    change, rather than the sampler's."""
    cases = {  # the job's line (by its comment), what the finding says of it, its fix
        "epoch_once": (
            "# once, before the loop",
            "set_epoch ran once, at {call}, not once per epoch",
            "into the epoch loop",
        ),
        "epoch_fixed": (
            "# the same epoch each time",
            "set_epoch ran 2 times at {call}, each time with epoch 3",
            "own counter",
        ),
    }
    for mode, (line, said_here, fix_here) in cases.items():
        (tmp_path / mode).mkdir()
        _, found = findings(tmp_path / mode, mode)
        (f,) = serious(found)
        call = f"misuse.py:{_line('misuse.py', f'sampler.set_epoch(start)  {line}')}"
        said = " ".join(f["summary"].split())
        assert f["kind"] == "missing_set_epoch" and said_here.format(call=call) in said, said
        assert f["details"]["place"] == call and fix_here in f["fix"], f


def _line(script: str, text: str) -> int:
    lines = (JOBS / script).read_text().splitlines()
    return next(n for n, t in enumerate(lines, 1) if t.strip().startswith(text))


def test_what_each_rank_read_decides_sharding_not_the_sampler(tmp_path: Path) -> None:
    for sub in "abc":
        (tmp_path / sub).mkdir()
    # A hard-coded rank=0 in DistributedSampler: half the data per rank by count, the same half.
    _, found = findings(tmp_path / "a", "same_shard")
    (f,) = serious(found)
    assert f["kind"] == "missing_distributed_sampler" and f["details"]["same_batches"] is True
    made = _line("misuse.py", "sampler = DistributedSampler(data, num_replicas=2, rank=0")
    said = " ".join(f["summary"].split())
    assert "identical batches" in said and f"created at misuse.py:{made}" in said, said
    assert "was built with rank=0 on every rank (num_replicas=2)" in said, said
    assert f["details"]["place"] == f"misuse.py:{made}" and "dist.get_rank()" in f["fix"], f
    assert "Pass sampler=DistributedSampler" not in f["fix"]  # it has one: the advice is its rank
    # Each rank loads its own split with a plain shuffling loader: different data, no warning.
    _, found = findings(tmp_path / "b", "presplit")
    assert serious(found) == []
    (f,) = [f for f in found if f["kind"] == "missing_distributed_sampler"]
    assert f["severity"] == "info" and f["details"]["same_batches"] is False
    # No set_epoch, but the seed moves each epoch: the order changes, nothing replays.
    _, found = findings(tmp_path / "c", "reseeded")
    assert serious(found) == []


@pytest.mark.parametrize(("kind", "phase"), [("data", "data_wait"), ("forward", "forward")])
def test_real_straggler_rank_and_phase(tmp_path: Path, kind: str, phase: str) -> None:
    code, found = findings(tmp_path, kind, "25", "--steps=32", script="straggler.py")  # 0.8 s lost
    assert code == 0
    (f,) = serious(found)
    assert (f["kind"], f["ranks"], f["details"]["phase"]) == ("straggler", [1], phase)
    assert 15 < f["details"]["excess_ms_per_step"] < 40
    assert f["details"]["what_if_speedup"] > 1.2
    assert "batch_elements" not in f["details"]  # the same batches: no claim that they differ


def test_a_straggler_sampled_while_it_lags_is_pointed_at_its_line(tmp_path: Path) -> None:
    """Long enough for the live rule to name rank 1 and for a 5 s profile of it and rank 0: the
    finding names the line in Net.forward where rank 1 spends its extra time, and the user's line
    that called it."""
    code, found = findings(tmp_path, "forward", "40", "--steps=250", script="straggler.py")
    assert code == 0
    (f,) = serious(found)
    text = (JOBS / "straggler.py").read_text().splitlines()
    forward = next(i for i, t in enumerate(text) if "def forward" in t)
    line = next(i for i, t in enumerate(text[forward:], forward + 1) if "time.sleep" in t)
    where = f["details"]["where"]
    assert (f["kind"], f["ranks"], where["line"], where["peer"]) == ("straggler", [1], line, 0), where
    assert where["share"] > 0.5 and where["peer_share"] < 0.1 and where["samples"] >= 100, where
    assert f"Net.forward() straggler.py:{line}" in f["summary"] and f["fix"].startswith(
        "Start at Net.forward()"
    )
    step = next(i for i, t in enumerate(text, 1) if "model(x)" in t)
    assert where["callers"] == [f"main() straggler.py:{step}"], "whose call of forward: the training loop's"
    assert f"called from main() straggler.py:{step}" in f["summary"]


def test_a_straggler_with_larger_batches_is_told_so_with_the_samplers_fix(tmp_path: Path) -> None:
    """Rank 1's samples are 1024-row sequences, the others' 4: as much data by count, far more
    work per step. The straggler finding says its batches are larger, by how much, and leads
    with balancing the sampler."""
    code, found = findings(tmp_path, "longer", "1024", "--steps=60", script="straggler.py")
    assert code == 0
    (f,) = serious(found)
    assert (f["kind"], f["ranks"]) == ("straggler", [1]) and f["details"]["phase"] in ("forward", "backward")
    sizes = f["details"]["batch_elements"]
    assert (sizes["elements"], sizes["others"]) == (8 * 1024 * 64 + 8, 8 * 4 * 64 + 8)  # inputs, labels
    assert f"its batches are {sizes['ratio']:.1f}x larger" in f["summary"] and sizes["ratio"] > 250
    assert f["fix"].startswith("Its batches hold more")
    assert "in the first batches of each pass" in f["summary"]


def test_a_straggler_whose_loop_makes_its_own_larger_batches_is_told_so_too(tmp_path: Path) -> None:
    """The same job with no DataLoader (the loop cuts each rank's shard itself): the DDP forward
    probe counts its inputs at sampled steps, so the finding still says the batches differ."""
    code, found = findings(tmp_path, "longer", "1024", "--steps=60", "--own-batches", script="straggler.py")
    assert code == 0
    (f,) = serious(found)
    assert (f["kind"], f["ranks"]) == ("straggler", [1]) and f["details"]["phase"] in ("forward", "backward")
    sizes = f["details"]["batch_elements"]
    assert (sizes["elements"], sizes["others"]) == (8 * 1024 * 64, 8 * 4 * 64)  # the forward's input
    assert "in its forwards' inputs at sampled steps" in f["summary"]
    assert f["fix"].startswith("Its batches hold more")
    text = (JOBS / "straggler.py").read_text().splitlines()
    cut = next(i for i, t in enumerate(text, 1) if "loader = [" in t)  # from `start`, the rank's
    assert f["details"]["place"] == f"straggler.py:{cut}"  # where the loop's batches are cut by rank
    assert f"Each rank's share is cut at straggler.py:{cut}." in f["fix"]


@pytest.mark.parametrize("job", ["healthy", "counted_train", "straggler_none"])
def test_healthy_jobs_have_no_warnings(tmp_path: Path, job: str) -> None:
    if job == "healthy":
        _, found = findings(tmp_path, "healthy")
    elif job == "straggler_none":
        _, found = findings(tmp_path, "none", "0", script="straggler.py", nproc=3)
    else:
        _, found = findings(tmp_path, script="counted_train.py")
    assert serious(found) == []
    assert not (tmp_path / "run" / "profile.json").exists(), "no straggler, no profile"


def test_demo_is_healthy_and_says_where_its_run_is(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "demo", "--out", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=180,
        env=job_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"run dir: {tmp_path / 'd'}" in proc.stderr
    assert "No problems found." in proc.stderr
    assert "batch size 32 per process, 64 global" in proc.stderr
    assert serious(diagnose_json(tmp_path / "d")["findings"]) == []


def test_a_loader_read_between_steps_on_one_rank_is_not_the_training_loader(
    tmp_path: Path, write_script
) -> None:
    """Rank 1 evaluates on a held-out loader (a SequentialSampler) between steps: the training
    loader is the one read last before each training forward, so the evaluation loader is not
    called the training DataLoader without a DistributedSampler, and its record names the
    evaluation's loop and the line that called it (two user frames)."""
    script = write_script(
        "evaluate.py",
        """
        import torch
        import torch.distributed as dist
        import torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


        def score(model, loader):
            with torch.no_grad():
                return sum(float(model(x).sum()) for (x,) in loader)


        dist.init_process_group("gloo")
        rank = dist.get_rank()
        data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
        train = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
        heldout = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=8)
        model = DDP(nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step, (x, y) in enumerate(train):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if rank == 1 and step % 2 == 1:
                score(model.module, heldout)
        dist.destroy_process_group()
        """,
    )
    job = run_doctor(tmp_path, torchrun(2, script))
    assert job.returncode == 0, job.stderr[-3000:]
    found = diagnose_json(job.run_dir)["findings"]
    assert not [f for f in found if f["kind"] == "missing_distributed_sampler"], found
    loaders = [r[4] for r in read_lines(job.run_dir / "trace-rank1.jsonl") if r[0] == "loader"]
    evaluation = [info for info in loaders if info.get("sampler") == "SequentialSampler"]
    assert evaluation, loaders
    assert evaluation[0]["stack"][:2] == ["evaluate.py:11 score", "evaluate.py:26 <module>"], evaluation
