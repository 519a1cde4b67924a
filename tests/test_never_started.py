"""Ranks that never reach init_process_group: what their processes leave (probes/early.py), what
the supervisor makes of it (ends.json), and the diagnosis of a run where no rank wrote a trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import diagnose_proc, job_env

from ddpdoctor.analysis import diagnose
from ddpdoctor.probes.early import PARENT_RANK_ENV, is_rank_process
from ddpdoctor.supervisor.ends import rank_ends
from ddpdoctor.supervisor.launch import job_environment
from ddpdoctor.trace.reader import load_run

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
# What faulthandler wrote for rank 0 when torchrun stopped it inside init_process_group.
WAITING_IN_INIT = (
    "Current thread 0x00007efcc8a0cb80 (most recent call first):\n"
    f'  File "{C10D}", line 2169 in _new_process_group_helper\n'
    f'  File "{C10D}", line 1899 in init_process_group\n'
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
    '  File "/job/train.py", line 19 in main\n'
    '  File "/job/train.py", line 26 in <module>\n'
)


def _proc(run_dir: Path, rank: int, **more: object) -> None:
    record = {"schema": "ddpdoctor.proc/1", "rank": rank, "world_size": 2, "pid": 100 + rank}
    record.update(started_wall=10.0 + rank, **more)
    (run_dir / f"proc-rank{rank}.json").write_text(json.dumps(record))


def _never_init_run(run_dir: Path) -> None:
    """Rank 1 printed an error and exited before init; torchrun then stopped rank 0 (SIGTERM)
    while it waited in init_process_group; neither wrote a trace."""
    run_dir.mkdir(exist_ok=True)
    _proc(run_dir, 0)
    _proc(run_dir, 1, exit_wall=12.0)
    (run_dir / "stderr-rank1.txt").write_text("config not found\n")
    (run_dir / "sigterm-rank0.txt").write_text(WAITING_IN_INIT)
    (run_dir / "fatal-rank0.txt").write_text("")  # enabled, never fired
    (run_dir / "run.json").write_text(json.dumps({"command": ["torchrun"], "exit_code": 1}))


def test_the_supervisor_says_how_ranks_that_never_initialised_ended(tmp_path: Path) -> None:
    _never_init_run(tmp_path)
    ends, first = rank_ends(tmp_path)
    assert first == 1
    assert ends["1"]["how"] == "exit" and ends["1"]["initialised"] is False
    assert ends["1"]["words"] == ["config not found"] and not ends["1"]["consequence"]
    assert ends["0"]["how"] == "signal" and ends["0"]["signal"] == "SIGTERM"
    assert ends["0"]["consequence"] and "after rank 1 failed" in ends["0"]["source"]
    assert "init_process_group" in ends["0"]["stack"]


def test_a_run_with_no_trace_is_diagnosed_from_the_supervisors_records(tmp_path: Path) -> None:
    _never_init_run(tmp_path)
    ends, first = rank_ends(tmp_path)
    (tmp_path / "ends.json").write_text(
        json.dumps({"schema": "ddpdoctor.ends/1", "ranks": ends, "first": first})
    )
    run = load_run([tmp_path])
    assert not run.ranks and run.world_size == 2
    findings = diagnose(run).findings
    errors = [f for f in findings if f.severity == "error"]
    assert [f.kind for f in errors] == ["rank_never_started"]
    f = errors[0]
    assert f.ranks == [1] and f.details["root_rank"] == 1 and f.details["waiting"] == [0]
    assert "config not found" in f.summary and "train.py:19" in f.summary
    assert "init_process_group" in f.fix
    assert not any(f.kind == "missing_ranks" for f in findings)  # known: they never initialised
    out = diagnose_proc(tmp_path)
    assert out.returncode == 1, out.stderr  # an error finding, not unreadable input (2)
    kinds = [f["kind"] for f in json.loads(out.stdout)["findings"]]
    assert "rank_never_started" in kinds


def test_a_run_dir_with_nothing_at_all_is_still_unreadable(tmp_path: Path) -> None:
    (tmp_path / "ends.json").write_text(json.dumps({"schema": "ddpdoctor.ends/1", "ranks": {}}))
    out = diagnose_proc(tmp_path)
    assert out.returncode == 2 and "no rank traces" in out.stdout


def test_only_the_launchers_rank_processes_record_their_start() -> None:
    worker = {"RANK": "1", "WORLD_SIZE": "2"}
    assert is_rank_process(worker)  # a torchrun worker: its parent (the agent) has no RANK
    assert is_rank_process({**worker, PARENT_RANK_ENV: ""})
    assert not is_rank_process({**worker, PARENT_RANK_ENV: "1"})  # started by rank 1 itself
    assert not is_rank_process({})  # torchrun's agent, mp.spawn's parent, a plain script
    assert not is_rank_process({"RANK": "1"})  # a RANK exported in a shell, no launcher
    assert not is_rank_process({"RANK": "x", "WORLD_SIZE": "2"})


def test_a_rank_process_that_exits_before_init_leaves_its_start_end_and_last_words(tmp_path: Path) -> None:
    """No torch at all: the record is taken at the process's start, by the bootstrap."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = job_environment(run_dir, job_env())
    env.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    env.pop(PARENT_RANK_ENV, None)
    code = (
        "import subprocess, sys\n"
        "subprocess.run([sys.executable, '-c', 'pass'], check=True)  # a child with RANK=1 too\n"
        "print('config not found', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "config not found" in proc.stderr  # the job's own output, unchanged
    record = json.loads((run_dir / "proc-rank1.json").read_text())
    assert record["rank"] == 1 and record["world_size"] == 2 and record["initialised"] is False
    assert record["exit_wall"] >= record["started_wall"]
    ends, first = rank_ends(run_dir)
    assert first == 1 and ends["1"]["how"] == "exit" and ends["1"]["pid"] == record["pid"]
    assert "config not found" in ends["1"]["words"]
