"""The story true at the edges, on real jobs: a collective that raised, a cut trace header, an
interrupt after a hang verdict, gradient accumulation, and every command's ``--json`` error."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import diagnose_json, free_port, job_env, read_lines, run_doctor, torchrun
from test_live_e2e import kill_tree

from ddpdoctor.trace import binfmt

pytestmark = pytest.mark.e2e

RAISED_JOB = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
# BatchNorm's buffers: every forward broadcasts them (broadcast_buffers=True)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(40):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    if rank == 1 and step == 12:
        raise SystemExit(3)  # rank 0's next buffer broadcast raises "Connection closed by peer"
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
dist.destroy_process_group()
"""


# Each rank started by hand and waited for, as `srun --kill-on-bad-exit=0` does: torchrun would
# stop rank 0 with SIGTERM a monitor interval (0.1 s) after rank 1 exits, and a cold rank 0 can
# take longer than that to raise (0.7 s seen with the page cache dropped).
LAUNCHER = """
import os, subprocess, sys
world = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[1]}
ranks = [
    subprocess.Popen([sys.executable, sys.argv[2]], env={**os.environ, **world, "RANK": r, "LOCAL_RANK": r})
    for r in ("0", "1")
]
sys.exit(max(rank.wait() for rank in ranks))
"""


def percentages(findings: list[dict]) -> list[int]:
    return [int(p) for f in findings for p in re.findall(r"(\d+)%", f["summary"])]


def test_a_collective_that_raised_is_recorded_as_raised_not_completed(tmp_path: Path, write_script) -> None:
    script = write_script("raised.py", RAISED_JOB)
    launcher = write_script("launch.py", LAUNCHER)
    job = run_doctor(tmp_path, [sys.executable, str(launcher), str(free_port()), str(script)], timeout=120)
    assert job.returncode != 0, job.stderr
    records = read_lines(job.run_dir / "trace-rank0.jsonl")
    raised = [r for r in records if r[0] == "raised"]
    assert {r[4]["kind"] for r in raised} == {"forward", "sync_buffers"}, raised
    seq = next(r[4]["fields"][0] for r in raised if r[4]["kind"] == "sync_buffers")
    # the broadcast that raised is no span: it enters no statistics
    assert not [r for r in records if r[0] == "sync_buffers" and r[4] == seq]
    assert max(r[3] for r in records if r[0] == "forward") == 11
    doc = diagnose_json(job.run_dir)
    r0 = doc["failure"]["ranks"]["0"]
    assert r0["open_point"] == f"buffer broadcast #{seq}", r0
    assert "buffer broadcast" not in r0["last_completed"] and "step 11" in r0["last_completed"], r0
    assert r0["step"] == 12 and r0["step_text"] == "at step 12, in its forward", r0
    labels = [s["label"] for s in doc["failure"]["open_spans"] if s["rank"] == 0]
    assert labels == ["forward", f"buffer broadcast #{seq}"], labels  # a forward has no seq number
    assert all(p <= 100 for p in percentages(doc["findings"])), [f["summary"] for f in doc["findings"]]
    # the root is rank 1's SystemExit(3), which printed nothing; rank 0's error is its consequence
    failure = next(f for f in doc["findings"] if f["kind"] == "rank_failure")
    assert failure["ranks"] == [1] and "exited with code 3" in failure["summary"], failure
    assert doc["failure"]["ranks"]["1"]["how"] == "exit_code", doc["failure"]["ranks"]["1"]


HANG_JOB = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(40):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    if rank == 0 and step == 31:
        print("hang-started", flush=True)
        dist.barrier()  # rank 0 only: rank 1 waits in step 32's gradient all-reduce
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rank-only barrier at step 31, proven hung and killed: a run dir to read, not to change."""
    where = tmp_path_factory.mktemp("hang")
    (where / "hang.py").write_text(HANG_JOB)
    job = run_doctor(where, torchrun(2, where / "hang.py"), "--on-hang", "kill", timeout=120)
    assert job.returncode == 124, job.stderr[-3000:]
    return job.run_dir


def test_a_cut_trace_header_keeps_the_rank_and_the_real_root(hung_run: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut"
    shutil.copytree(hung_run, cut)
    trace = cut / "trace-rank1.bin"
    data = trace.read_bytes()
    _, start, end = next(binfmt.blocks(data))
    trace.write_bytes(data[: start + 60] + data[end:])  # the header block cut mid-write
    whole, doc = diagnose_json(hung_run), diagnose_json(cut)
    assert [(f["kind"], f["ranks"]) for f in doc["findings"] if f["severity"] == "error"] == [
        (f["kind"], f["ranks"]) for f in whole["findings"] if f["severity"] == "error"
    ]
    assert not [f for f in doc["findings"] if f["kind"] in ("rank_never_started", "missing_ranks")]
    assert doc["failure"]["ranks"]["1"]["step"] == whole["failure"]["ranks"]["1"]["step"] == 32
    assert any("rank 1's trace header was cut" in n for n in doc["run"]["notes"]), doc["run"]["notes"]
    spans = {(s["rank"], s["label"]): s for s in doc["failure"]["open_spans"]}
    for key, span in {(s["rank"], s["label"]): s for s in whole["failure"]["open_spans"]}.items():
        assert abs(spans[key]["start_s"] - span["start_s"]) < 0.05, (key, spans[key], span)  # clock placed


def test_ctrl_c_after_a_hang_verdict_is_told_as_the_users_interrupt(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text(HANG_JOB)
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "ddpdoctor", "run", "--out", str(run_dir), "--", *torchrun(2, "hang.py")]
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "hang-1" / "summary.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (run_dir / "hang-1" / "summary.json").exists(), "no hang verdict"
        time.sleep(1.0)
        for _ in range(30):  # the stall shows once no step began for 10 step periods (>= 2 s)
            top = subprocess.run(
                [sys.executable, "-m", "ddpdoctor", "top", "--once", "--json", str(run_dir)],
                capture_output=True, text=True, timeout=60, env=job_env(),
            )  # fmt: skip
            frame = json.loads(top.stdout)
            if all(row["state"] == "stalled" for row in frame["ranks"]):
                break
            time.sleep(1.0)
        for row in frame["ranks"]:  # no stale rate, not "running"
            assert row["state"] == "stalled" and row["steps_per_s"] == 0, row
        assert frame["job"]["steps_per_s"] == 0, frame["job"]
        proc.send_signal(signal.SIGINT)  # --on-hang dump (the default) left the job hung: Ctrl-C
        proc.communicate(timeout=90)
    finally:
        proc.kill()
    ends = json.loads((run_dir / "ends.json").read_text())
    assert ends["first"] is None, ends  # no rank failed first: the user stopped the job
    for end in ends["ranks"].values():
        assert end["interrupted"] and "Ctrl-C" in end["source"] and "launcher" not in end["source"], end
    doc = diagnose_json(run_dir)
    view = doc["failure"]
    assert "the user interrupted it (Ctrl-C)" in view["verdict"], view["verdict"]
    assert [m["title"] for m in view["markers"]] == ["hang verdict", "Ctrl-C"], view["markers"]
    for end in view["ranks"].values():
        assert end["how"] == "interrupted" and "SIGKILL" not in end["how_text"] + end["mark"], end
    assert view["ranks"]["1"]["step"] == 32
    assert not [f for f in doc["findings"] if "SIGKILL" in f["summary"] or "after rank" in f["summary"]]


@pytest.mark.parametrize(
    "command",
    [
        ["diagnose", "--json", "{missing}"],
        ["report", "--json", "{missing}"],
        ["export", "--json", "{missing}"],
        ["compare", "--json", "{missing}", "{missing}"],
        ["attach", "--json", "{missing}"],
        ["top", "--json", "--once", "{missing}"],
        ["top", "--json", "--once", "{unrelated}"],
    ],
)
def test_json_on_a_missing_directory_is_one_error_object(tmp_path: Path, command: list[str]) -> None:
    (tmp_path / "unrelated").mkdir()
    (tmp_path / "unrelated" / "notes.txt").write_text("not a run\n")
    where = {"missing": str(tmp_path / "missing"), "unrelated": str(tmp_path / "unrelated")}
    args = [a.format(**where) for a in command]
    proc = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", *args], capture_output=True, text=True, timeout=60, env=job_env()
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    doc = json.loads(proc.stdout)  # exactly one JSON object: nothing else on stdout
    assert isinstance(doc, dict) and doc["error"] and doc["schema"].startswith("ddpdoctor."), doc
    assert doc["error"] in proc.stderr


ACCUMULATION_JOB = """
import contextlib
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(40):
    for micro in range(4):  # 3 micro-batches under no_sync(), the 4th all-reduces
        with contextlib.nullcontext() if micro == 3 else model.no_sync():
            loss = nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
            (loss / 4).backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def test_gradient_accumulation_counts_optimizer_steps(tmp_path: Path, write_script) -> None:
    job = run_doctor(tmp_path, torchrun(2, write_script("accum.py", ACCUMULATION_JOB)), timeout=120)
    assert job.returncode == 0, job.stderr[-3000:]
    forwards = [r for r in read_lines(job.run_dir / "trace-rank0.jsonl") if r[0] == "forward"]
    assert len(forwards) == 160 and sorted({r[3] for r in forwards}) == list(range(40))
    doc = diagnose_json(job.run_dir)
    assert doc["run"]["steps"] == {"0": 40, "1": 40}, doc["run"]["steps"]
    findings = doc["findings"]
    assert all(p <= 100 for p in percentages(findings)), [f["summary"] for f in findings]
    assert not [f for f in findings if "accumulation with no_sync()" in (f.get("fix") or "")]


def test_an_attached_hang_reads_true_in_diagnose_and_report(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text(HANG_JOB)
    log = (tmp_path / "job.log").open("w")
    job = subprocess.Popen(torchrun(2, "hang.py"), cwd=tmp_path, env=job_env(), stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 90
        while "hang-started" not in (tmp_path / "job.log").read_text() and time.monotonic() < deadline:
            assert job.poll() is None, (tmp_path / "job.log").read_text()
            time.sleep(0.2)
        time.sleep(1.0)
        out = tmp_path / "attached"
        args = ["attach", str(job.pid), "--watch", "2", "--out", str(out)]
        looked = subprocess.run(
            [sys.executable, "-m", "ddpdoctor", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=job_env(),
        )
        assert looked.returncode == 1 and "STUCK" in looked.stdout, looked.stdout + looked.stderr
    finally:
        kill_tree(job.pid)  # the launcher and its ranks (each in a session of its own)
        job.wait(timeout=30)
        log.close()
    doc = diagnose_json(out)
    assert "#-1" not in json.dumps(doc), [f["summary"] for f in doc["findings"]]
    view = doc["failure"]
    assert all(m["time_s"] >= 0 for m in view["markers"]), view["markers"]  # no verdict before the start
    for span in view["open_spans"]:  # stuck from the first look to the verdict: about the 2 s watched
        assert span["start_s"] >= 0 and span["end_s"] - span["start_s"] >= 1.0, span
    for end in view["ranks"].values():  # at step 32, which no trace recorded: not "step 0"
        assert end["step"] == -1 and "unknown" in end["step_text"] and "first step" not in end["step_text"], (
            end
        )
    html = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "report", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=job_env(),
    )
    assert html.returncode == 0, html.stderr
    title = re.search(r"<title>([^<]*)</title>", (out / "report.html").read_text(encoding="utf-8")).group(1)
    assert "0 step" not in title and "unknown" in title, title
    text = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "diagnose", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=job_env(),
    ).stdout
    assert "#-1" not in text and "at step 0" not in text and "before its first step" not in text, text


def test_a_hang_timeline_opens_on_the_last_steps(hung_run: Path) -> None:
    view = diagnose_json(hung_run)["failure"]
    lo, hi = view["window_s"]
    stuck = max(s["start_s"] for s in view["open_spans"])
    kill = next(m["time_s"] for m in view["markers"] if m["kind"] == "kill")
    assert stuck < hi < kill, (lo, hi, stuck, kill)  # the stuck spans run on past the right edge
    assert (stuck - lo) / (hi - lo) > 0.6  # the last steps fill most of the axis


def test_the_phase_table_fits_and_shades_nothing_at_two_ranks(hung_run: Path) -> None:
    page = (hung_run / "report.html").read_text(encoding="utf-8")
    table = page[page.index('<section id="phases">') :]
    table = table[: table.index("</section>")]
    phases = table.count("colspan=") - 1  # less the step time
    columns = table.split("</tr><tr>")[1].split("</tr>")[0].count("<th>")
    assert columns <= 2 * phases + 2 and columns <= 20, columns  # about 40 before: a scrollbar at 1,400 px
    assert "background:rgba" not in table  # at two ranks one is always the slower: nothing to show


def test_a_command_that_cannot_start_leaves_no_run_dir(tmp_path: Path) -> None:
    args = ["run", "--out", str(tmp_path / "run"), "--", "no_such_command_anywhere"]
    proc = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", *args], capture_output=True, text=True, env=job_env()
    )
    assert proc.returncode == 127 and "command not found" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_second_run_into_a_used_out_is_refused_and_the_first_kept(tmp_path: Path, write_script) -> None:
    """A run's files in --out would mix with the next run's: a job that succeeded was reported
    with the last one's error. The second run is refused before it starts (exit 2)."""
    failing = write_script("failing.py", """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        raise ValueError("boom")
        """)  # fmt: skip
    marker = tmp_path / "started"
    healthy = write_script("healthy.py", f"open({str(marker)!r}, 'w').close()\n")

    def run(script: Path) -> subprocess.CompletedProcess:
        args = ["run", "--out", str(tmp_path / "run"), "--", *torchrun(2, script)]
        command = [sys.executable, "-m", "ddpdoctor", *args]
        return subprocess.run(command, capture_output=True, text=True, env=job_env(), timeout=180)

    first = run(failing)
    assert first.returncode == 1 and "ValueError" in first.stderr, first.stderr[-3000:]
    second = run(healthy)
    assert second.returncode == 2, second.stderr[-3000:]
    assert "holds an earlier run: give a new directory, or remove that one" in second.stderr
    assert not marker.exists()  # nothing was started
    kept = diagnose_json(tmp_path / "run")  # the first run's diagnosis, unchanged
    assert any("ValueError" in json.dumps(f) for f in kept["findings"]), kept
    # attach, and bench for its DDP run's directory, refuse it too, before doing anything
    (tmp_path / "bench").mkdir()
    shutil.copytree(tmp_path / "run", tmp_path / "bench" / "ddp")
    for args in (["attach", "1", "--out", "run"], ["bench", "--out", "bench"]):
        command = [sys.executable, "-m", "ddpdoctor", *args]
        refused = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=job_env())
        assert refused.returncode == 2 and "holds an earlier run" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "bench" / "bench.json").exists()


def test_a_quoted_error_is_cut_at_a_word() -> None:
    from ddpdoctor.analysis.findings import clip

    text = "Connection closed by peer [127.0.0.1]:7399. This is typically caused by a remote worker"
    assert clip(text, 200) == text
    assert clip(text, 80) == "Connection closed by peer [127.0.0.1]:7399. This is typically caused by a..."


def test_the_license_is_an_spdx_expression() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"  # a table is deprecated by setuptools (PEP 639)
    assert "setuptools>=77" in project["build-system"]["requires"]
