"""The run directory honours the umask and is never world-writable; traces are only JSON."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import job_env

from ddpdoctor.trace.reader import read_trace


@pytest.mark.parametrize(("umask", "dir_mode"), [("000", 0o775), ("077", 0o700), ("022", 0o755)])
def test_run_dir_honours_umask_and_is_never_world_writable(tmp_path: Path, umask: str, dir_mode: int) -> None:
    out = tmp_path / "run"
    script = f"umask {umask}; exec {sys.executable} -m ddpdoctor run --out {out} -- {sys.executable} -c pass"
    proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=job_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(out.stat().st_mode) == dir_mode
    for path in out.iterdir():
        assert not path.stat().st_mode & stat.S_IWOTH, path


def test_trace_content_is_never_executed(tmp_path: Path) -> None:
    """A hostile trace (pickle opcodes, code-looking strings) is read as data and skipped."""
    marker = tmp_path / "pwned"
    (tmp_path / "trace-rank0.jsonl").write_text(
        '["header",{"schema":"ddpdoctor.trace/1","rank":0,"world_size":1,"host":"h","pid":1,'
        '"wall_ns":0,"mono_ns":0}]\n'
        f"[\"forward\",0,5,0,\"__import__('os').system('touch {marker}')\",1,0]\n"
        "cos\nsystem\n(S'touch " + str(marker) + "'\ntR.\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "diagnose", "--json", str(tmp_path)],
        capture_output=True,
        text=True,
        env=job_env(),
        timeout=60,
    )
    assert proc.returncode in (0, 1), proc.stderr
    assert not marker.exists()
    run = json.loads(proc.stdout)["run"]
    assert run["ranks"] == [0]
    assert "skipped 4 truncated or corrupt trace line(s)" in run["notes"]  # the pickle lines


def test_hostile_lines_never_reach_the_columns(tmp_path: Path) -> None:
    """Lines shaped almost like a bulk-parsed kind (a leading zero, a float, a string in an int's
    place, an escape in a string, a too-long integer) are read by json or skipped, never parsed
    into wrong numbers by the fast path."""
    path = tmp_path / "trace-rank0.jsonl"
    path.write_text(
        '["header",{"schema":"ddpdoctor.trace/1","rank":0,"world_size":1,"host":"h","pid":1,'
        '"wall_ns":0,"mono_ns":0}]\n'
        '["forward",10,5,0,1,1,7]\n'
        '["forward",010,5,0,1,1,7]\n'  # invalid JSON: skipped
        '["forward",20,5.5,0,1,1,7]\n'  # a float duration: not an event
        '["forward",30,5,0,"1",1,7]\n'  # a string grad flag: kept as json gives it
        '["collective",40,5,0,"a\\"b",8,"WORLD",2,3,0]\n'
        '["forward",12345678901234567890,5,0,1,1,7]\n'  # past int64: skipped
    )
    trace = read_trace(path)
    fwd = trace.kind("forward")
    assert fwd.ts.tolist() == [10, 30]
    assert list(fwd.fields) == [(1, 1, 7), ("1", 1, 7)]
    coll = trace.kind("collective")
    assert list(coll.fields) == [('a"b', 8, "WORLD", 2, 3, 0)]
    assert trace.skipped_lines == 3
