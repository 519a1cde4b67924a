"""The run directory honours the umask and is never world-writable; traces are only JSON."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import job_env


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
