"""Shared helpers: run real jobs under `ddpdoctor run` and read what they left."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

JOBS = Path(__file__).parent / "jobs"
REPO = Path(__file__).parent.parent


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("DDPDOCTOR_RUN_DIR", None)
    env.update(extra)
    return env


def torchrun(nproc: int, script: Path | str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]


# gloo in torch 2.13 now and then aborts a rank at interpreter exit, after the job's work and
# destroy_process_group() are done, with or without ddpdoctor (pytorch/pytorch#179291 describes
# the finalization race). A plain torchrun run of tests/jobs/seeded_train.py did it in CI.
EXIT_ABORT = "terminate called without an active exception"


def _once_more_on_exit_abort(launch, before_retry=lambda: None):
    """Run ``launch()``; run it once more when it failed by gloo's exit abort, saying so."""
    proc = launch()
    if proc.returncode != 0 and EXIT_ABORT in proc.stderr:
        print(f"conftest: the job aborted at exit ({EXIT_ABORT!r}); running it once more", file=sys.stderr)
        before_retry()
        proc = launch()
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_doctor(cwd: Path, command: list[str], *options: str, timeout: float = 180, **env: str) -> Job:
    """`ddpdoctor run --out CWD/run OPTIONS -- COMMAND`, as a user would type it."""
    run_dir = cwd / "run"

    def launch() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ddpdoctor", "run", "--out", str(run_dir), *options, "--", *command],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=job_env(**env),
        )

    proc = _once_more_on_exit_abort(launch, lambda: shutil.rmtree(run_dir, ignore_errors=True))
    return Job(proc.returncode, proc.stdout, proc.stderr, run_dir)


def run_plain(cwd: Path, command: list[str], timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    """The same command without ddpdoctor: the control group."""
    return _once_more_on_exit_abort(
        lambda: subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=job_env(**env)
        )
    )


def diagnose_proc(*run_dirs: Path) -> subprocess.CompletedProcess:
    """`ddpdoctor diagnose --json RUN_DIRS` as a user runs it, whatever it exits with."""
    return subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "diagnose", "--json", *map(str, run_dirs)],
        capture_output=True,
        text=True,
        timeout=120,
        env=job_env(),
    )


def diagnose_json(*run_dirs: Path) -> dict:
    proc = diagnose_proc(*run_dirs)
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def read_lines(path: Path) -> list[list]:
    """A JSON-lines file's records; a rank's binary trace (``trace-rankN.bin``, or
    ``trace-rankN.jsonl`` naming the binary one beside it) as its JSON-lines export."""
    from ddpdoctor.trace import binfmt

    binary = path.with_suffix(".bin")
    if path.suffix == ".bin" or (path.suffix == ".jsonl" and not path.exists() and binary.exists()):
        return binfmt.records(binfmt.decode(binary.read_bytes()))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def write_script(tmp_path: Path):
    """Write a job script (dedented) into the test's directory and return its path."""

    def write(name: str, source: str) -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


@pytest.fixture(scope="session")
def native_timer() -> Path:
    """The C++ bucket timer, built for this torch (``dev.py`` builds it; else here, once): the
    tests that need it run it, they do not skip."""
    from ddpdoctor.probes import native

    return native.build()[0]
