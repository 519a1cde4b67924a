"""A rank's exit status and where it asked for it (probes/lastwords.py, probes/_fast.c's on_exit
handler), in real processes: Python tells no hook the status of sys.exit(3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import job_env

from ddpdoctor.supervisor.ends import _one_end

pytest.importorskip("ddpdoctor.probes._fast")

PRELUDE = """
import sys, types
from ddpdoctor.probes import lastwords
lastwords._exit_code(types.SimpleNamespace(run_dir=sys.argv[1], rank=0))
"""
CASES = {
    "sys_exit": ("def stop():\n    sys.exit(3)\nstop()", 3, "stop"),
    "builtin_exit": ("def stop():\n    exit(4)\nstop()", 4, "stop"),
    "message": ("sys.exit('bad shard')", 1, "<module>"),
    "raise": ("raise SystemExit(5)", 5, None),  # calls nothing: a status without a line
    "caught": ("try:\n    sys.exit(3)\nexcept SystemExit:\n    pass", 0, None),  # the call it caught
    "end": ("x = 1", 0, None),
    "native": ("import ctypes\nctypes.CDLL(None).exit(6)", 6, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_status_and_its_call_are_written_as_the_process_exits(tmp_path: Path, case: str) -> None:
    body, code, function = CASES[case]
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + body + "\n")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=job_env(), capture_output=True)
    assert proc.returncode == code, proc.stderr
    record = json.loads((tmp_path / "exit-rank0.json").read_text())
    assert (record["how"], record["code"]) == ("exit", code), record
    end = _one_end(tmp_path, 0, {"pid": 1}, case != "native", None)
    assert (end["how"], end["code"]) == ("exit", code), end
    if function is None:
        assert "frames" not in end, end
    else:  # outermost first: the caller's own frame last
        assert end["frames"][-1][0] == str(script) and end["frames"][-1][2] == function, end["frames"]
    if case == "native":
        assert "native code" in end["source"], end


def test_a_forked_child_leaves_the_parents_record_alone(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    after_fork = "import os\nif os.fork() == 0:\n    sys.exit(9)\nos.wait()\n"
    check = "print(os.path.exists(sys.argv[1] + '/exit-rank0.json'))\nsys.exit(2)\n"
    script.write_text(PRELUDE + after_fork + check)
    run = [sys.executable, str(script), str(tmp_path)]
    proc = subprocess.run(run, env=job_env(), capture_output=True, text=True)
    assert (proc.returncode, proc.stdout) == (2, "False\n"), proc.stderr  # the child wrote nothing
    assert json.loads((tmp_path / "exit-rank0.json").read_text())["code"] == 2
