"""Every way a rank can die leaves its whole record: real 2-rank gloo jobs under `ddpdoctor run`.

For each death the dying rank's trace must hold every step it ran (the steps it printed) up
to its last event, ends.json and the rank_failure finding must name the end exactly, and its
last stderr lines must be quoted. The job itself must die exactly as it would without us
(torchrun reports the same exit code or signal of the rank).
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import JOBS, diagnose_json, job_env, read_lines, run_doctor, torchrun

from ddpdoctor.trace import schema

pytestmark = pytest.mark.e2e

DIE_AT = 9
# mode: (dying rank, how, signal, torchrun's "exitcode" of that rank, a dying word)
DEATHS = {
    "abort": (
        0,
        "signal",
        "SIGABRT",
        "-6",
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
    ),
    "segv": (1, "signal", "SIGSEGV", "-11", "rank 1 dying by segv"),
    "sigkill": (1, "signal", "SIGKILL", "-9", "rank 1 dying by sigkill"),
    "sigterm": (1, "signal", "SIGTERM", "-15", "rank 1 dying by sigterm"),
    "os_exit": (1, "os_exit", None, "7", "rank 1 dying by os_exit"),
    "sys_exit": (1, "exit", None, "3", "rank 1 dying by sys_exit"),
    "c_exit": (1, "exit", None, "5", "rank 1 dying by c_exit"),
    "raise": (1, "exception", None, "1", "RuntimeError: rank 1 gives up at step 9"),
}


def printed_steps(stdout: str, rank: int) -> list[int]:
    return [int(ln.split()[2]) for ln in stdout.splitlines() if ln.startswith(f"step {rank} ")]


def run_death(tmp_path: Path, mode: str, step_s: float, **env: str):
    job = run_doctor(
        tmp_path,
        torchrun(
            2, JOBS / "dying_train.py", "--mode", mode, "--die-at", str(DIE_AT), "--step-s", str(step_s)
        ),
        **env,
    )
    assert job.returncode != 0, job.stderr
    return job


@pytest.mark.parametrize("step_s", [0.0, 0.15], ids=["short", "long"])
@pytest.mark.parametrize("mode", list(DEATHS))
def test_a_dying_rank_keeps_every_step_and_its_last_words(
    tmp_path: Path, mode: str, step_s: float, native_timer: Path
) -> None:
    rank, how, sig, exitcode, word = DEATHS[mode]
    job = run_death(tmp_path, mode, step_s)
    # The patient died exactly as it would: torchrun saw the same exit code or signal.
    assert f"exitcode: {exitcode})" in job.stderr.replace("exitcode : ", "exitcode: ") or (
        f"(exitcode: {exitcode})" in job.stderr
    ), job.stderr[-3000:]
    # Every step the rank ran is in its trace, up to its last event.
    ran = printed_steps(job.stdout, rank)
    assert ran == list(range(DIE_AT)), job.stdout
    trace = read_lines(job.run_dir / f"trace-rank{rank}.jsonl")
    forwards = [r[3] for r in trace if r[0] == schema.FORWARD]
    collectives = [r for r in trace if r[0] == schema.COLLECTIVE and r[4] == "all_reduce"]
    if mode == "abort":  # it died inside step 9's metrics all_reduce, after its forward
        assert forwards == list(range(DIE_AT + 1)), forwards
    else:  # it died before step 9's forward: the last recorded event is step 8's all_reduce
        assert forwards == list(range(DIE_AT)), forwards
        # (a fingerprint at exit may follow: step 8 completed its optimizer step)
        last = [r[0] for r in trace if r[0] not in (schema.END, schema.FINGERPRINT)][-1]
        assert collectives[-1][3] == DIE_AT - 1 and last in (schema.COLLECTIVE, schema.RANK_ERROR), trace[-3:]
    # And each gradient bucket it reduced, once: the C++ timer's notes outlive the rank.
    reduced = sorted((r[3], r[4]) for r in trace if r[0] == schema.ALLREDUCE)
    assert reduced == [(step, 0) for step in forwards], reduced
    # Which parameters that bucket holds, drained on the training thread in the first steps.
    assert any(r[0] == schema.BUCKET for r in trace), trace[:12]
    assert not any(r[0] == schema.DROPPED for r in trace)
    ends = json.loads((job.run_dir / "ends.json").read_text())
    end = ends["ranks"][str(rank)]
    assert (end["how"], end["signal"]) == (how, sig), end
    assert any(word in w for w in end["words"]), end["words"]
    assert ends["first"] == rank, ends
    found = diagnose_json(job.run_dir)["findings"]
    failure = next((f for f in found if f["kind"] == "rank_failure"), None)
    if failure is None and mode == "abort":
        # When the backend's last words name the size mismatch, the ledgers prove it: the
        # mismatch is the cause and rank 0's SIGABRT is its consequence (kept in its evidence).
        cause = found[0]
        assert cause["kind"] == "collective_mismatch", found
        (failure_text,) = [c for c in cause["details"]["consequences"] if c.startswith("rank_failure")]
        assert f"rank {rank} was killed by {sig}" in failure_text and word in failure_text
        return
    assert failure is not None, found
    assert failure["ranks"] == [rank], failure
    # Counted as the report counts: before step 9's forward, or inside step 9, is step 9.
    assert failure["details"]["at_step"] == DIE_AT, failure
    assert failure["details"]["last_step_started"] == DIE_AT - (mode != "abort"), failure
    if sig is not None:
        assert f"rank {rank} was killed by {sig}" in failure["summary"], failure["summary"]
    if mode != "raise":  # an exception's finding quotes its traceback instead
        assert word in failure["summary"], failure["summary"]
    if mode in ("sys_exit", "c_exit"):  # no traceback, no signal: its exit status alone says it failed
        code = int(exitcode)
        assert end["code"] == code and f"rank {rank} exited with code {code}" in failure["summary"], failure
        assert ("native code" in end["source"]) == (mode == "c_exit"), end
    if mode == "os_exit":  # the line that called it: the probe keeps its caller's stack
        source = (JOBS / "dying_train.py").read_text().splitlines()
        line = next(n for n, text in enumerate(source, 1) if text.strip() == "os._exit(7)")
        assert f"(dying_train.py:{line} in die)" in failure["summary"], failure["summary"]
        assert failure["details"]["place"] == f"dying_train.py:{line}"
    if mode == "segv":  # the stack faulthandler wrote at the crash: the line that made the native call
        source = (JOBS / "dying_train.py").read_text().splitlines()
        line = next(n for n, text in enumerate(source, 1) if text.strip() == "ctypes.string_at(0)")
        assert f"(dying_train.py:{line} in die, inside " in failure["summary"], failure["summary"]
        assert failure["details"]["place"] == f"dying_train.py:{line}" and "fatal-rank1.txt" in failure["fix"]
        assert "PYTHONFAULTHANDLER" not in failure["fix"], "it has the stack already"


def test_sigterm_from_the_launcher_is_a_consequence_not_the_root(tmp_path: Path) -> None:
    """Rank 1 is killed; torchrun then stops rank 0 with SIGTERM while it waits in a collective."""
    job = run_death(tmp_path, "sigkill", 0.15)
    ends = json.loads((job.run_dir / "ends.json").read_text())
    zero = ends["ranks"]["0"]
    assert ends["first"] == 1, ends
    assert ends["ranks"]["1"]["signal"] == "SIGKILL"  # inferred, or seen as a zombie by the watcher
    if zero["how"] == "signal":  # rank 0 may also see the broken connection and raise first
        assert zero["signal"] == "SIGTERM" and zero["consequence"] is True, zero
        assert "after rank 1 failed" in zero["source"], zero
    else:
        assert zero["how"] == "exception" and zero["consequence"] is True, zero


def test_a_ring_too_small_to_hold_the_gap_says_what_it_lost(tmp_path: Path, native_timer: Path) -> None:
    """An 8-slot ring laps itself many times a flush interval: training goes on unchanged, the
    trace keeps everything flushed plus the ring's last events, and a dropped record counts
    exactly the events in between. The C++ timer's notes wait in their own file for the flush
    that never came (the training thread drains them only in the first steps): the bucket
    all-reduces from then on are all kept."""
    job = run_death(tmp_path, "sigkill", 0.0, DDPDOCTOR_BUFFER_EVENTS="8", DDPDOCTOR_FLUSH_S="30")
    assert printed_steps(job.stdout, 1) == list(range(DIE_AT))
    trace = read_lines(job.run_dir / "trace-rank1.jsonl")
    events = [r for r in trace[1:] if r[0] in schema.KINDS]  # metadata is written at once
    noted = [r[3] for r in events if r[0] == schema.ALLREDUCE]
    events = [r for r in events if r[0] != schema.ALLREDUCE]
    dropped = [r[4]["count"] for r in trace if r[0] == schema.DROPPED]
    assert len(events) == 8 and len(dropped) == 1, trace  # no event was flushed in 30 s
    assert events[-1][0] == schema.COLLECTIVE and events[-1][3] == DIE_AT - 1
    assert noted and noted == list(range(DIE_AT - len(noted), DIE_AT)), noted
    completed = json.loads((job.run_dir / "ends.json").read_text())["completed"]["trace-rank1.bin"]
    assert completed == {"recovered": 8 + len(noted), "lost": dropped[0]}


def test_no_room_for_the_ring_records_as_before(tmp_path: Path) -> None:
    """The ring's space cannot be reserved: the rank logs it once and records without it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "trace-rank1.ring").symlink_to("/dev/full")
    job = run_doctor(tmp_path, torchrun(2, JOBS / "dying_train.py", "--mode", "none", "--steps", "12"))
    assert job.returncode == 0, job.stderr
    assert printed_steps(job.stdout, 1) == list(range(12))
    assert "rank 1: no crash-safe ring" in (run_dir / "probe-errors.log").read_text()
    forwards = [r[3] for r in read_lines(run_dir / "trace-rank1.jsonl") if r[0] == schema.FORWARD]
    assert forwards == list(range(12))


TTY_JOB = """
import os
import torch.distributed as dist

dist.init_process_group("gloo")
os.write(2, f"tty{dist.get_rank()}={os.isatty(2)} a\\tb\\r\\nc\\n".encode())
dist.barrier()
dist.destroy_process_group()
"""


def run_in_pty(cwd: Path, command: list[str]) -> bytes:
    """Run ``command`` with a terminal on stdin/stdout/stderr; everything the terminal showed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(command, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, env=job_env())
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    proc.wait(timeout=120)
    os.close(master)
    return shown


def test_a_terminal_sees_the_same_bytes_and_the_job_still_sees_a_tty(tmp_path: Path, write_script) -> None:
    script = write_script("tty_job.py", TTY_JOB)
    plain = run_in_pty(tmp_path, torchrun(2, script))
    doctor = run_in_pty(
        tmp_path, [sys.executable, "-m", "ddpdoctor", "run", "--out", "run", "--", *torchrun(2, script)]
    )
    for rank in (0, 1):
        line = f"tty{rank}=True a\tb\r\r\nc\r\n".encode()  # the outer terminal's own \n -> \r\n only
        assert line in plain, plain
        assert line in doctor, doctor
        assert f"tty{rank}=True a\tb" in (tmp_path / "run" / f"stderr-rank{rank}.txt").read_text()


WORKER_KILLED_IN_FORWARD = """
import os, signal, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

IN_FORWARD = f"in-forward-{os.environ['RANK']}"

class Samples(Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        if int(os.environ["RANK"]) == 1 and i == 33 and torch.utils.data.get_worker_info():
            while not os.path.exists(IN_FORWARD):  # the main thread is in its first forward
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)  # stands in for the OOM killer
        return torch.randn(16), i % 4

class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        open(IN_FORWARD, "w").close()
        t = time.monotonic()
        while time.monotonic() - t < 30:  # Python work: where the SIGCHLD handler raises
            pass
        return self.fc(x)

dist.init_process_group("gloo")
data = Samples()
loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False), num_workers=2)
model = DDP(Slow())
for x, y in loader:
    nn.functional.cross_entropy(model(x), y).backward()
dist.destroy_process_group()
"""


def test_a_worker_killed_while_the_rank_computes_names_the_loader(tmp_path: Path, write_script) -> None:
    """The worker's death surfaces where the main thread is when SIGCHLD arrives (here its
    forward); the finding names the loader it read, and the failure view the forward."""
    script = write_script("killed_worker.py", WORKER_KILLED_IN_FORWARD)
    job = run_doctor(tmp_path, torchrun(2, script), timeout=120)
    assert job.returncode == 1, job.stderr
    doc = diagnose_json(job.run_dir)
    failure = next(f for f in doc["findings"] if f["kind"] == "rank_failure")
    assert failure["ranks"] == [1] and "killed by a signal (SIGKILL)" in failure["summary"], failure
    assert "of the DataLoader iterated at killed_worker.py:36" in failure["summary"], failure
    assert failure["details"]["place"] == "killed_worker.py:36" and "num_workers" in failure["fix"]
    r1 = doc["failure"]["ranks"]["1"]
    assert r1["step_text"] == "at step 0, in its forward", r1
    # the handler runs where the main thread is: in its loop, or (a rank descheduled right after
    # it made the file, on a loaded machine) still on the line that made it
    lines = ("26", "27", "28", "29")
    assert r1["user_frame"] in [f"forward() killed_worker.py:{n}" for n in lines], r1


def test_a_worker_killed_while_the_rank_waits_for_its_batch_is_a_data_wait(tmp_path: Path) -> None:
    script = Path(__file__).parent / "zoo" / "loader_worker_killed.py"
    job = run_doctor(tmp_path, torchrun(2, script), timeout=120)
    assert job.returncode == 1, job.stderr
    r1 = diagnose_json(job.run_dir)["failure"]["ranks"]["1"]
    assert r1["open_point"] == "data wait" and r1["step_text"] == "before its first step", r1


FORKED_HELPER = """
    import multiprocessing as mp
    import os
    import time

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP


    def helper(started):
        started.set()
        while True:
            time.sleep(0.01)


    def main():
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        child = None
        if rank == 0:  # the job's own forked helper, stopped by SIGTERM at the end
            started = mp.get_context("fork").Event()
            child = mp.get_context("fork").Process(target=helper, args=(started,), daemon=True)
            child.start()
            started.wait()
        model = DDP(nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        if child is not None:
            child.terminate()
            child.join()
            print("helper ended by", child.exitcode)
        dist.destroy_process_group()


    main()
"""


def test_a_forked_helper_stopped_by_sigterm_is_not_the_rank_dying(tmp_path: Path, write_script) -> None:
    """A child the rank forked inherits the rank's SIGTERM and crash handlers: its SIGTERM must
    not write stacks into the rank's files, where the job read as rank 0 killed by SIGTERM."""
    job = run_doctor(tmp_path, torchrun(2, write_script("forked_helper.py", FORKED_HELPER)), timeout=120)
    assert job.returncode == 0, job.stderr
    assert "helper ended by -15" in job.stdout
    assert (job.run_dir / "sigterm-rank0.txt").read_text() == ""
    doc = diagnose_json(job.run_dir)
    assert [f for f in doc["findings"] if f["severity"] != "info"] == [], doc["findings"]


SILENT_PEER = """
    import os
    import signal
    import sys

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP


    def main():
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if rank == 1:  # dies of what it raises without a word: no traceback, no rank_error record
            sys.excepthook = lambda *exc: os.kill(os.getpid(), signal.SIGKILL)
        torch.manual_seed(0)
        model = DDP(nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(20):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            if rank == 0 and step == 5:
                raise RuntimeError("rank 0 gives up after step 5")


    main()
"""


def test_a_peer_that_dies_of_its_backwards_error_without_a_word_is_placed_in_its_all_reduce(
    tmp_path: Path, write_script
) -> None:
    """Rank 0 raises after step 5; rank 1's gradient all-reduce of step 6 then raises, and its
    own excepthook SIGKILLs it: no traceback, no rank_error, no stack. Its trace's ``raised``
    backward still puts it in that all-reduce, a consequence of rank 0 (or, if the launcher's
    SIGTERM reaches it first, its stack in backward does)."""
    job = run_doctor(tmp_path, torchrun(2, write_script("silent_peer.py", SILENT_PEER)), timeout=120)
    assert job.returncode != 0, job.stderr
    doc = diagnose_json(job.run_dir)
    failure = next(f for f in doc["findings"] if f["kind"] == "rank_failure")
    summary = failure["summary"]
    assert failure["ranks"] == [0] and "rank 0 gives up" in summary, summary
    assert "rank 1: at step 6, in its backward, in gradient all-reduce" in summary, summary
