"""Real jobs through the real CLI: a hang (the eval trap, killed on hang), a rank that raises and
a rank killed by a signal each leave a report, an export and ``diagnose --json`` that draw the
failure where it happened: open spans to the verdict, the kill or the death, the moments, and
the failure section first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import JOBS, diagnose_json, job_env, run_doctor, torchrun

pytestmark = pytest.mark.e2e


def export(run_dir: Path) -> list[dict]:
    out = run_dir / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "report", str(run_dir), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=job_env(),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())["traceEvents"]


def check_everywhere(run_dir: Path) -> dict:
    """The failure in the JSON, the export and the page agree; returns the JSON's view."""
    view = diagnose_json(run_dir)["failure"]
    assert view is not None and view["schema"] == "ddpdoctor.failure/1"
    ends = {int(r): e["end_s"] for r, e in view["ranks"].items()}
    for span in view["open_spans"]:  # each drawn to the end of its rank's record
        assert span["did_not_finish"] and abs(span["end_s"] - ends[span["rank"]]) < 1e-3, span
    events = export(run_dir)
    open_x = [e for e in events if e["ph"] == "X" and e["args"].get("did_not_finish")]
    assert len(open_x) == len(view["open_spans"])
    for e in open_x:
        assert abs((e["ts"] + e["dur"]) / 1e6 - ends[e["pid"]]) < 1e-3, e
    moments = {e["cat"] for e in events if e["ph"] == "i" and e["s"] == "g"}
    assert moments == {m["kind"] for m in view["markers"]}
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert page.index('id="failure"') < page.index('id="timeline-section"') < page.index('id="findings"')
    assert "did not finish" in page
    return view


def test_the_eval_trap_is_drawn_to_the_kill(tmp_path: Path) -> None:
    job = run_doctor(
        tmp_path,
        torchrun(2, JOBS / "faulty_train.py", "--mode", "eval0"),
        "--hang-timeout",
        "10",
        "--on-hang",
        "kill",
        timeout=120,
    )
    assert job.returncode == 124, job.stderr[-3000:]
    view = check_everywhere(job.run_dir)
    assert view["kind"] == "hang" and view["verdict"].startswith("The job hung (proven")
    kill = next(m["time_s"] for m in view["markers"] if m["kind"] == "kill")
    verdict = next(m["time_s"] for m in view["markers"] if m["kind"] == "verdict")
    assert verdict <= kill < verdict + 5
    spans = {(s["rank"], s["kind"]): s for s in view["open_spans"]}
    assert set(spans) == {(0, "forward"), (0, "sync_buffers"), (1, "collective")}
    seq = spans[(1, "collective")]["seq"]
    assert spans[(0, "sync_buffers")]["seq"] == seq and spans[(1, "collective")]["op"] == "barrier"
    assert spans[(0, "forward")]["label"] == "forward (no grad)"
    assert spans[(0, "sync_buffers")]["user_frame"] == "evaluate() faulty_train.py:28"
    assert spans[(1, "collective")]["user_frame"] == "main() faulty_train.py:71"
    assert all(s["seconds"] > 1.0 and s["end_s"] == pytest.approx(kill, abs=1e-3) for s in spans.values())
    assert view["parting"]["seq"] == seq
    assert [g["ranks"] for g in view["stacks"]] == [[0], [1]]


@pytest.mark.parametrize("mode", ["raise", "sigkill"])
def test_a_dying_rank_is_drawn_to_its_death_at_the_loops_step(tmp_path: Path, mode: str) -> None:
    job = run_doctor(
        tmp_path, torchrun(2, JOBS / "dying_train.py", "--mode", mode, "--die-at", "7", "--steps", "20")
    )
    assert job.returncode != 0
    view = check_everywhere(job.run_dir)
    assert view["kind"] == "failure" and view["first_rank"] == 1
    dead = view["ranks"]["1"]
    # It died before step 7's forward (the loop's step 7, counted from 0 as the trace counts).
    assert dead["step"] == 7 and "before its forward" in dead["step_text"], dead
    assert dead["mark"] == ("RuntimeError" if mode == "raise" else "SIGKILL")
    death = next(m for m in view["markers"] if m["kind"] == "death")
    assert death["rank"] == 1 and death["time_s"] == pytest.approx(dead["end_s"], abs=1e-3)
    # The survivor's wait for its dead peer: its step 7 backward, which did not finish. Which
    # reaches it first is a race outside our code: gloo's error (the backward raised: the span
    # its raised record names) or torchrun's SIGTERM (its death stack in the backward: the
    # live phase's spans, the gradient all-reduce on the comm lane too, seen in CI once).
    survivor = [s for s in view["open_spans"] if s["rank"] == 0]
    assert [s["kind"] for s in survivor] in (["backward"], ["backward", "allreduce"])
    assert {s["step"] for s in survivor} == {7}
    assert view["ranks"]["0"]["step_text"].startswith("at step 7, in its backward")
    assert survivor[0]["seconds"] > 0 and dead["end_s"] < survivor[0]["end_s"]
    # Where they parted: rank 0 entered the next gradient all-reduce, rank 1 never issued it.
    row = view["parting"]["rows"][str(view["parting"]["seq"])]
    assert row["0"]["op"] == "gradient all-reduce" and row["0"]["in_flight"] and row["1"] is None


SAVE_FAILS = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    if step == 5 and rank == 1:
        torch.save(model.state_dict(), "no/such/dir/ckpt.pt")
dist.destroy_process_group()
"""


def test_an_error_between_sync_points_is_placed_in_the_users_line(tmp_path: Path, write_script) -> None:
    """torch.save raising after the optimizer step (through the checkpoint probe's wrapper) is
    no sync point that did not finish; the finding names the user's line, the other rank where
    its own record says it stopped."""
    job = run_doctor(tmp_path, torchrun(2, write_script("save_fails.py", SAVE_FAILS)), timeout=120)
    assert job.returncode == 1, job.stderr
    doc = diagnose_json(job.run_dir)
    view = check_everywhere(job.run_dir)
    r1 = view["ranks"]["1"]
    assert r1["open_point"] == "" and r1["user_frame"] == "<module>() save_fails.py:13", r1
    assert r1["step_text"] == "at step 6, before its forward (step 5's backward had finished)", r1
    failure = next(f for f in doc["findings"] if f["kind"] == "rank_failure")
    assert "(save_fails.py:13 in <module>, inside serialization.py:" in failure["summary"], failure
    assert failure["fix"].startswith("Fix the RuntimeError that rank 1 raised at save_fails.py:13 in")
    assert '(`torch.save(model.state_dict(), "no/such/dir/ckpt.pt")`)' in failure["fix"], failure  # the line
    assert "Others then: rank 0: at step 6, in its backward" in failure["summary"], failure


BUDGET_BREAK = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Trainer:
    def __init__(self, model, loader, budget):
        self.model, self.loader, self.budget = model, loader, budget

    def train_epoch(self):
        seen = 0
        for x, y in self.loader:
            nn.functional.cross_entropy(self.model(x), y).backward()
            seen += int(x.abs().sum() > 0) * (1 + dist.get_rank())  # rank 1 counts faster
            if seen >= self.budget:
                break


dist.init_process_group("gloo")
data = TensorDataset(torch.randn(320, 8), torch.randint(0, 2, (320,)))
loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False))
Trainer(DDP(nn.Linear(8, 2)), loader, budget=12).train_epoch()
dist.barrier()
dist.destroy_process_group()
"""

COLLATE_RAISES = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def collate(batch):
    x = torch.stack([b[0] for b in batch])
    assert dist.get_rank() == 0 or x[0, 0] != 99, "a corrupt sample"
    return x, torch.stack([b[1] for b in batch])


dist.init_process_group("gloo")
xs = torch.randn(160, 8)
xs[2 * 8 * 5 + 1, 0] = 99  # rank 1's first sample of step 5 (no shuffle, 2 ranks, batches of 8)
data = TensorDataset(xs, torch.randint(0, 2, (160,)))
loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False), collate_fn=collate)
model = DDP(nn.Linear(8, 2))
for x, y in loader:
    nn.functional.cross_entropy(model(x), y).backward()
dist.destroy_process_group()
"""


def test_a_per_rank_break_in_a_function_the_others_are_in_is_named(tmp_path: Path, write_script) -> None:
    """Rank 1 breaks out of Trainer.train_epoch's loop on its own count after 6 of its 20
    batches and waits in the barrier after the call; rank 0 is still in the loop. The finding
    is the rank that left, by that break, not a rank-only barrier nor uneven inputs."""
    script = write_script("budget.py", BUDGET_BREAK)
    job = run_doctor(tmp_path, torchrun(2, script), "--hang-timeout", "6", "--on-hang", "kill", timeout=120)
    assert job.returncode == 124, job.stderr
    found = [f for f in diagnose_json(job.run_dir)["findings"] if f["severity"] == "error"]
    assert found[0]["kind"] == "rank_left_early" and found[0]["ranks"] == [1], found
    said = found[0]["summary"]
    assert "by the `break` at budget.py:17, under `if seen >= self.budget:` (budget.py:16)" in said, said


def test_a_batch_that_raises_is_placed_in_the_next_steps_data_wait(tmp_path: Path, write_script) -> None:
    job = run_doctor(tmp_path, torchrun(2, write_script("collate.py", COLLATE_RAISES)), timeout=120)
    assert job.returncode == 1, job.stderr
    doc = diagnose_json(job.run_dir)
    r1 = doc["failure"]["ranks"]["1"]
    assert r1["step_text"] == "at step 5, in its data wait (step 4's backward had finished)", r1
    (f,) = [f for f in doc["findings"] if f["kind"] == "rank_failure"]
    assert f["ranks"] == [1] and "collate.py:9 in collate" in f["summary"], f
    assert "raised while loading a batch" in f["fix"] and "rank 1's shard" in f["fix"]


HAND_SYNC = """
import torch, torch.distributed as dist, torch.nn as nn

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    model(torch.randn(4, 8)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    if step == 3 and dist.get_rank() == 1:
        raise ValueError("bad batch")
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def test_a_loop_that_syncs_its_gradients_by_hand_is_placed_by_its_optimizer_steps(
    tmp_path: Path, write_script
) -> None:
    """Steps are counted from a DDP model's forwards; a loop without the wrapper has none, and
    a rank that failed after three optimizer steps was said to have failed before its first."""
    job = run_doctor(tmp_path, torchrun(2, write_script("by_hand.py", HAND_SYNC)), timeout=120)
    assert job.returncode == 1, job.stderr
    doc = diagnose_json(job.run_dir)
    r1 = doc["failure"]["ranks"]["1"]
    assert r1["step_text"] == "after 3 optimizer step(s), no DDP forward on record", r1
    (f,) = [f for f in doc["findings"] if f["kind"] == "rank_failure"]
    assert f["ranks"] == [1] and "failed first after 3 optimizer step(s)" in f["summary"], f


def test_a_metric_key_of_one_ranks_own_is_counted_and_after_earlier_rounds_named(tmp_path: Path) -> None:
    """Metrics all-reduced key by key, rank 1's dict one key longer. At the job's first sync no
    earlier round says whose count is right: both counts and the loop, no root. At the fourth,
    three rounds of two keys then the gradient all-reduce say it: rank 1's third call is extra."""
    job = run_doctor(tmp_path, torchrun(2, JOBS / "metric_keys.py", "first"), "--hang-timeout", "6",
                     "--on-hang", "kill")  # fmt: skip
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "collective_mismatch"]
    said = " ".join(f["summary"].split())
    loop = next(
        i for i, t in enumerate((JOBS / "metric_keys.py").read_text().splitlines(), 1) if "for value in" in t
    )
    assert "a different number of times in a row (3 time(s) on rank(s) 1, 2 time(s) on rank(s) 0)" in said, (
        said
    )
    assert f"in the loop at metric_keys.py:{loop} (`for value in metrics.values():`)" in said, said
    assert f["details"]["root_rank"] is None and "fixed list of names" in f["fix"]
    later = tmp_path / "later"
    later.mkdir()
    job = run_doctor(
        later, torchrun(2, JOBS / "metric_keys.py", "later"), "--hang-timeout", "6", "--on-hang", "kill"
    )
    errors = [f for f in diagnose_json(job.run_dir)["findings"] if f["severity"] == "error"]
    (f,) = [f for f in errors if f["kind"] == "rank_only_collective"]
    said = " ".join(f["summary"].split())
    assert f["ranks"] == [1] and f["details"]["root_rank"] == 1, f
    assert (
        "rank 1 made the all_reduce at metric_keys.py:" in said
        and "one more time than in any earlier round" in said
    )
    assert "in each of 3 earlier round(s) every rank made it 2 time(s), then gradient all-reduce" in said, (
        said
    )
