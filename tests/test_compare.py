"""`ddpdoctor compare` on two real runs: the same job healthy, then with a straggling rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import JOBS, job_env, run_doctor, torchrun

pytestmark = pytest.mark.e2e


def _compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "compare", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=job_env(),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    dirs = []
    for name, kind, delay in (("healthy", "none", "0"), ("slow", "forward", "25")):
        cwd = tmp_path_factory.mktemp(name)
        job = run_doctor(cwd, torchrun(2, JOBS / "straggler.py", kind, delay, "--steps=24"))
        assert job.returncode == 0, job.stderr
        dirs.append(job.run_dir)
    return dirs[0], dirs[1]


def test_compare_json_shows_the_slower_run_and_its_new_finding(runs: tuple[Path, Path]) -> None:
    a, b = runs
    proc = _compare(str(a), str(b), "--json")
    assert proc.returncode == 0, proc.stderr
    cmp = json.loads(proc.stdout)
    assert cmp["schema"] == "ddpdoctor.compare/1"
    assert cmp["a"]["run_dirs"] == [str(a)] and cmp["b"]["run_dirs"] == [str(b)]
    assert cmp["a"]["world_size"] == cmp["b"]["world_size"] == 2
    assert cmp["a"]["steps"] == cmp["b"]["steps"] == 24
    # 25 ms more forward on one rank per step: B is slower, and the forward phase says why.
    assert cmp["a"]["samples_per_s"] > 0 and cmp["b"]["samples_per_s"] > 0
    assert cmp["throughput"]["samples_per_s_ratio"] < 0.8
    assert cmp["step_time_ratio"]["p50"] > 1.25
    assert cmp["phases"]["forward"]["delta_s"] > 0.008
    only_b = {f["kind"] for f in cmp["findings"]["only_b"]}
    assert "straggler" in only_b
    assert "straggler" not in {f["kind"] for f in cmp["findings"]["only_a"]}
    assert "straggler" not in cmp["findings"]["both"]
    # Swapping the sides swaps the findings and inverts the ratios.
    swapped = json.loads(_compare(str(b), str(a), "--json").stdout)
    assert "straggler" in {f["kind"] for f in swapped["findings"]["only_a"]}
    assert swapped["throughput"]["samples_per_s_ratio"] > 1.25


def test_compare_terminal_and_bad_input(runs: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = runs
    proc = _compare(str(a), str(b))
    assert proc.returncode == 0, proc.stderr
    assert "only in B: warning straggler" in proc.stdout
    assert "samples/s" in proc.stdout and "forward" in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80
    missing = _compare(str(a), str(tmp_path / "nope"))
    assert missing.returncode == 2 and "not a directory" in missing.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _compare(str(empty), str(b)).returncode == 2


def test_a_kind_the_other_run_has_only_as_a_note_counts_as_new() -> None:
    """A healthy run on a busy 2-core machine can carry a straggler note (a rank 0.6 ms late,
    12 ms in all); the same kind as a warning in the other run is what changed."""
    from ddpdoctor.analysis.slow.compare import _worse, _worst

    def found(*pairs: tuple[str, str]) -> list[dict]:
        return [{"kind": k, "severity": s, "summary": k} for k, s in pairs]

    a = found(("straggler", "info"), ("comm_bound", "info"))
    b = found(("straggler", "warning"), ("comm_bound", "info"), ("data_wait", "warning"))
    only_b = _worse(b, _worst(a))
    assert [(f["kind"], f["other_severity"]) for f in only_b] == [("straggler", "info"), ("data_wait", None)]
    assert _worse(a, _worst(b)) == []  # nothing is worse in A
    assert sorted(k for k, r in _worst(a).items() if _worst(b).get(k) == r) == ["comm_bound"]
